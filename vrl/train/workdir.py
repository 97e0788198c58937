"""The workdir's guards: one run writes it, starting over keeps the old run, restarts are recorded.

- `hold(workdir)`: one writer per workdir, taken by process 0 of a run (all processes of one run
  share the workdir). A local workdir: `Lock`, an exclusive `flock` on `WORKDIR/.lock`, which the
  kernel drops when the holder dies (kill -9, a lost VM), so a stale lock never blocks. A workdir
  on an object store, where nothing can be locked: `Lease`, the object `WORKDIR/.lock` created only
  if absent, renewed by its holder, and taken over once it has not been renewed for
  train.lease_stale_seconds. Either names the holder in the refusal.
- `start_over`: what `--fresh` does. The old run (checkpoints, metrics, config.json,
  TensorBoard) moves to `WORKDIR/previous_runs/<time>/`; nothing is deleted. A run that
  `--fresh` started keeps resuming under the same command (and config) until it finishes, so
  "run the same command to resume" holds after a preemption.
- `record_start`: config.json holds the current config and, under `history`, every start:
  its step and what changed since the previous one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from etils import epath

from vrl.core import storage
from vrl.core.config import Config
from vrl.core.errors import VrlError

# the tokenizer a run started from Hugging Face weights came with (with a tokenizer.json, its config)
TOKENIZER_FILES = ('tokenizer.model', 'tokenizer.json', 'tokenizer_config.json')
WANDB_RUN_ID = 'wandb_run_id'  # the W&B run this workdir's run logs to (vrl/train/tracking.py)
RUN_FILES = ('checkpoints', 'metrics.jsonl', 'config.json', 'tensorboard', *TOKENIZER_FILES, WANDB_RUN_ID)


class WorkdirError(VrlError, RuntimeError):
    """The workdir cannot be used as asked; the message says why and what to do."""


class NotARunError(VrlError, FileNotFoundError):
    """A folder given as a run's workdir holds no run record (config.json)."""


def _holder() -> str:
    return f'host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime("%Y-%m-%d %H:%M:%S")}'


class Lock:
    """A local workdir's: held from `acquire` until `release` or the process's death."""

    def __init__(self, workdir: epath.Path, holder_kind: str = 'run'):
        self.path = workdir / '.lock'
        self.holder_kind = holder_kind  # what holds it, for the refusal: 'run', 'comparison', 'study'
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode(errors='replace').strip() or 'a process that is starting'
            os.close(fd)
            raise WorkdirError(f'workdir {self.path.parent} is in use by another {self.holder_kind} ({holder}); '
                               'stop it or choose another --workdir.') from None
        os.ftruncate(fd, 0)
        os.write(fd, _holder().encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Lease:
    """A workdir on an object store's: `WORKDIR/.lock` (JSON: holder, token, renewed at), created only
    if absent and rewritten by a thread every stale_after / 4 seconds while held. A lease not renewed
    for `stale_after` seconds belongs to a holder that died (kill -9, a lost VM): the next run takes
    it over and says so. A holder that finds its lease taken (it hung longer than stale_after) stops
    renewing and logs an error; `lost` tells."""

    def __init__(self, workdir: epath.Path, holder_kind: str = 'run', stale_after: float = 300.0):
        self.path, self.holder_kind, self.stale_after = workdir / '.lock', holder_kind, stale_after
        self.token = uuid.uuid4().hex
        self.lost = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({'holder': _holder(), 'token': self.token, 'renewed': time.time()}).encode()

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # written by something else: as good as stale
            return {'holder': 'an unreadable lease', 'token': '', 'renewed': 0.0}

    def acquire(self) -> str:
        """Takes the lease; returns a line for the log when it took over a stale one. WorkdirError if
        a live holder has it."""
        taken_over = ''
        if not storage.create_exclusive(self.path, self._record()):
            held = self._read() or {'holder': 'a run that just released it', 'renewed': time.time()}
            age = time.time() - float(held.get('renewed', 0.0))
            if age < self.stale_after:
                raise WorkdirError(
                    f'workdir {self.path.parent} is in use by another {self.holder_kind} ({held.get("holder")}; '
                    f'lease renewed {age:.0f} s ago); stop it or choose another --workdir. A holder that died '
                    f'loses the lease {self.stale_after:.0f} s after its last renewal '
                    '(train.lease_stale_seconds).')
            storage.delete(self.path)
            if not storage.create_exclusive(self.path, self._record()):
                raise WorkdirError(f'workdir {self.path.parent}: another {self.holder_kind} took over the stale '
                                   'lease first; stop it or choose another --workdir.')
            taken_over = (f'took over the lease of workdir {self.path.parent} from {held.get("holder")}: not '
                          f'renewed for {age:.0f} s (train.lease_stale_seconds={self.stale_after:.0f})')
            logging.warning('%s', taken_over)
        self._renewer = threading.Thread(target=self._renew, name='vrl-lease', daemon=True)
        self._renewer.start()
        return taken_over

    def _renew(self) -> None:
        while not self._stop.wait(self.stale_after / 4):
            try:
                held = self._read()
                if held is None or held.get('token') != self.token:
                    self.lost = True
                    logging.error('the lease of workdir %s was taken over by %s; this run no longer holds it',
                                  self.path.parent, (held or {}).get('holder', 'nobody'))
                    return
                self.path.write_bytes(self._record())
            except Exception as e:  # noqa: BLE001 - a passing outage: try again at the next renewal
                logging.warning('renewing the lease of workdir %s failed (%s); retrying', self.path.parent, e)

    def release(self) -> None:
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        held = self._read()
        if held is not None and held.get('token') == self.token:
            storage.delete(self.path)


def claim(guard: Lock | Lease) -> None:
    """Creates the guard's workdir and proves it writable (StorageError in one line naming the path
    and what to do, before anything is compiled or written), then takes the guard; a stale lease taken
    over is said on stdout."""
    storage.check_writable(guard.path.parent, '--workdir')
    if taken_over := guard.acquire():
        print(taken_over, flush=True)


def hold(workdir: epath.Path, holder_kind: str = 'run', stale_after: float = 300.0) -> Lock | Lease:
    """The guard that keeps a second writer out of `workdir`: a flock locally, a lease on an object store."""
    if storage.is_remote(workdir):
        return Lease(workdir, holder_kind, stale_after)
    return Lock(workdir, holder_kind)


def _read_record(workdir: epath.Path) -> dict[str, Any] | None:
    try:
        return json.loads((workdir / 'config.json').read_text())
    except (OSError, ValueError):
        return None


def _has_run(workdir: epath.Path) -> bool:
    return any((workdir / name).exists() for name in RUN_FILES)


def start_over(workdir: epath.Path, config: Config, latest_step: int | None) -> str:
    """`--fresh`: moves the workdir's run aside, unless it is the unfinished run that `--fresh`
    started with this same config (then it resumes). Returns what was done, for the log."""
    record = _read_record(workdir)
    if (record is not None and record.get('started_fresh') and record.get('config') == as_json(config)
            and latest_step is not None and latest_step < config.train.steps):
        return (f'--fresh: resuming the run that --fresh started at {record.get("started", "?")} with this '
                f'config (step {latest_step}); to start over again, change the command or workdir')
    if not _has_run(workdir):
        return '--fresh: the workdir holds no run'
    target = workdir / 'previous_runs' / time.strftime('%Y%m%dT%H%M%S')
    target.mkdir(parents=True)
    for name in RUN_FILES:
        if (workdir / name).exists():
            storage.move(workdir / name, target / name)
    return f'--fresh: moved the previous run to {target}'


def keep_tokenizer(workdir: epath.Path, source: epath.Path, chosen: str) -> str:
    """Copies the tokenizer a run starts with (and a tokenizer.json's tokenizer_config.json, which
    names its special tokens) into the workdir, unless the workdir's run already has one (a resume
    keeps the tokenizer it trained with); returns the line for the log."""
    kept = workdir / source.name
    if kept.exists() and (workdir / 'checkpoints').exists():
        return f'{chosen}: the workdir keeps the one its run trained with, {kept}'
    workdir.mkdir(parents=True, exist_ok=True)
    beside = source.parent / 'tokenizer_config.json'
    if source.name == 'tokenizer.json' and beside.exists():
        storage.write_bytes(workdir / beside.name, beside.read_bytes())
    storage.write_bytes(kept, source.read_bytes())
    return f'{chosen}, copied to {kept}'


def as_json(config: Config) -> dict[str, Any]:
    """The config as config.json stores it (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """'section.field' -> [old, new] for each field of `new` (an as_json config) that differs in `old`."""
    return {f'{section}.{key}': [old.get(section, {}).get(key), value]
            for section, values in new.items() for key, value in values.items()
            if old.get(section, {}).get(key) != value}


def last_read(workdir: epath.Path) -> dict[str, Any] | None:
    """What the run in `workdir` read at its last start (pipeline.provenance), if recorded."""
    return (_read_record(workdir) or {}).get('data')


def record_start(workdir: epath.Path, config: Config, step: int, fresh: bool, extra: dict[str, Any]) -> dict[str, list]:
    """Writes config.json for a start at `step` and returns the settings changed since the last start."""
    record = _read_record(workdir) or {}
    new = as_json(config)
    changed = changes(record['config'], new) if step and 'config' in record else {}
    history = record.get('history', []) + [{'step': step, 'time': time.strftime('%Y-%m-%d %H:%M:%S'),
                                            'changed': changed}]
    started_fresh = record.get('started_fresh', False) if step else fresh
    started = record.get('started', history[-1]['time']) if step else history[-1]['time']
    storage.write_bytes(workdir / 'config.json', json.dumps(
        {'config': new, **extra, 'started_fresh': started_fresh, 'started': started, 'history': history},
        indent=2).encode())
    return changed
