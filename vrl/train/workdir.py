"""The workdir's guards: one run writes it, starting over keeps the old run, restarts are recorded.

- `make_guard(workdir)`: one writer per workdir, taken by process 0 of a run (all processes of one run
  share the workdir). A local workdir: `Lock`, an exclusive `flock` on `WORKDIR/.lock`, which the
  kernel drops when the holder dies (kill -9, a lost VM), so a stale lock never blocks. A workdir
  on an object store, where nothing can be locked: `Lease`, the object `WORKDIR/.lock`, written
  only on the generation its writer read, renewed by its holder, and taken over once it has not
  changed for train.lease_stale_seconds. Either names the holder in the refusal; `confirm()`
  before each write stops a holder that lost it.
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
from typing import Any, Callable

from etils import epath

from vrl.core import peers, storage
from vrl.core.config import Config
from vrl.core.errors import VrlError

# the tokenizer a run started from Hugging Face weights came with (with a tokenizer.json, its config)
TOKENIZER_FILES = ('tokenizer.model', 'tokenizer.json', 'tokenizer_config.json')
WANDB_RUN_ID = 'wandb_run_id'  # the W&B run this workdir's run logs to (vrl/train/trackers/wandb.py)
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
        self.lost = ''  # a flock is never lost while its holder lives
        self.created = False  # whether `take` made the workdir
        self.epoch = 0  # a flock is its own fence: step folders keep Orbax's plain names
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

    def confirm(self) -> None:
        """The kernel holds a flock for its holder's life: nothing to check before a write."""

    def commit(self, step: int | None = None, logged_bytes: int | None = None) -> None:
        """Nothing to record: only a live holder writes, and Orbax's rename commits a step."""

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class LeaseLostError(WorkdirError):
    """This run's lease on its workdir was taken over, or could not be renewed in time: another run
    may be writing there, so this one writes nothing more."""


class Lease:
    """A workdir on GCS's: the object `WORKDIR/.lock` (JSON: holder, token), which one run at a time
    holds, proven by the object's generation (GCS changes it at every write):

    - taking it: create it only if absent, or replace a released one or one whose holder is gone;
      every write is conditional on the generation read before it, so of two runs racing for it
      exactly one wins;
    - a holder renews it (a conditional rewrite) from its own thread every stale_after / 4 s;
    - a holder is gone when the generation stays the same for stale_after seconds of the waiting
      run's own clock, `elapsed_seconds` (no clocks are compared); `take_over=True` takes it at once;
    - the holder writes only while its lease is surely its own: `confirm()`, before each checkpoint
      and upload, raises LeaseLostError once a renewal found the lease taken, or when no renewal
      has succeeded for stale_after / 2 s and one more attempt fails. A taker waits stale_after
      after the holder's last renewal, so the holder stops writing first.
    - releasing it writes a released record (conditional too); the next run takes that at once.

    The record is also the run's fence. Each taking starts an `epoch` (the previous record's plus
    one), in whose names the holder writes (checkpoint steps STEP.eEPOCH, metrics.eEPOCH.jsonl), and
    `commit` adds what became readable (`committed`: step -> epoch; `logged`: epoch -> bytes of its
    metrics) by the same conditional rewrite: a holder that lost the lease can still write bytes in its
    own names, but never commit them, so no reader (vrl/train/checkpoint.py, `read_metrics`) sees them.
    """

    def __init__(self, workdir: epath.Path, holder_kind: str = 'run', stale_after: float = 300.0,
                 take_over: bool = False, say=print, clock: Callable[[], float] | None = None):
        self.path, self.holder_kind, self.stale_after = workdir / '.lock', holder_kind, stale_after
        self.take_over, self.say = take_over, say
        self._clock = clock or elapsed_seconds  # every staleness is measured on it
        self.store_gone: Callable[[str], None] = peers.abort  # ends the process: the store does not answer
        self.token = uuid.uuid4().hex
        self.holder = _holder()
        self.epoch = 0  # of this run's taking (process 0's until `Member` shares it)
        self.committed: dict[int, int] = {}  # readable checkpoint step -> the epoch that wrote it
        self.logged: dict[int, int] = {}  # epoch -> bytes of its metrics file that are readable
        self.lost = ''  # why this run no longer holds the lease, once it does not
        self.created = False  # whether `take` made the workdir
        self._generation = 0  # of the lease object as this run last wrote it
        self._renewed_at = 0.0  # when (self._clock) the last successful renewal was sent
        self._lock = threading.Lock()  # one conditional write at a time
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self, released: bool = False) -> bytes:
        return json.dumps({'holder': self.holder, 'token': self.token, 'released': released,
                           'written': time.strftime('%Y-%m-%d %H:%M:%S'), 'epoch': self.epoch,
                           'committed': self.committed, 'logged': self.logged}).encode()

    def _read(self) -> tuple[dict[str, Any], int] | None:
        found = storage.read_versioned(self.path)
        if found is None:
            return None
        try:
            return json.loads(found[0]), found[1]
        except ValueError:  # not a lease (a local workdir's flock file, copied up with it): free
            return {'holder': 'a .lock that is not a lease', 'token': '', 'released': True}, found[1]

    def _succeed(self, held: dict[str, Any] | None) -> None:
        """This run's epoch and readable objects, taking over from record `held` (None: the first)."""
        fence = read_fence_record(held or {})
        self.epoch, self.committed, self.logged = fence.epoch + 1, fence.committed, fence.logged

    def _write(self, generation: int) -> bool:
        """Writes this run's record over `generation`; whether it did."""
        sent = self._clock()
        written = storage.write_if(self.path, self._record(), generation)
        if written is None:
            return False
        self._generation, self._renewed_at = written, sent
        return True

    def acquire(self) -> str:
        """Takes the lease, waiting out a holder that stopped renewing; returns a line for the log when
        it took one over. WorkdirError if a live holder has it."""
        while True:
            found = self._read()
            self._succeed(found and found[0])
            if found is None:
                if self._write(0):
                    break
                continue  # created by another run meanwhile: read it
            held, generation = found
            if held.get('released'):
                if self._write(generation):
                    break
                continue
            if not self.take_over:
                self._wait_out(held, generation)
            if not self._write(generation):
                raise WorkdirError(f'workdir {self.path.parent}: another {self.holder_kind} ({self._holder_now()}) '
                                   'took the lease over first; stop it or choose another --workdir.')
            line = (f'took over the lease of workdir {self.path.parent} from {held.get("holder")}: '
                    + ('--take_over_lease' if self.take_over else
                       f'not renewed for {self.stale_after:.0f} s (train.lease_stale_seconds)'))
            logging.warning('%s', line)
            self._start_renewing()
            return line
        self._start_renewing()
        return ''

    def _wait_out(self, held: dict[str, Any], generation: int) -> None:
        """Returns once `generation` has stayed the live one for stale_after seconds; WorkdirError as
        soon as it changes (its holder renewed it, or another run took it)."""
        deadline = self._clock() + self.stale_after
        self.say(f'workdir {self.path.parent} is leased by {held.get("holder")}: taking it over in '
                 f'{self.stale_after:.0f} s unless its holder renews it (train.lease_stale_seconds; '
                 '--take_over_lease if that run is surely gone)')
        said = self._clock()
        while (left := deadline - self._clock()) > 0:
            time.sleep(min(left, max(1.0, self.stale_after / 16)))
            found = self._read()
            if found is None or found[1] != generation:
                renewed = found is not None and found[0].get('token') == held.get('token')
                how = ('it renewed its lease while this one waited' if renewed else
                       f'it took the lease over from {held.get("holder")} while this one waited')
                raise WorkdirError(f'workdir {self.path.parent} is in use by another {self.holder_kind} '
                                   f'({self._holder_now(found)}; {how}); stop it or choose another --workdir.')
            if self._clock() - said >= 30 and left > 5:
                self.say(f'  ... {left:.0f} s until the lease of {self.path.parent} is taken over')
                said = self._clock()

    def _holder_now(self, found: tuple[dict[str, Any], int] | None | bool = False) -> str:
        """Who holds the lease as the store says now (`found`: a read already made)."""
        found = self._read() if found is False else found
        return 'nobody: it was deleted' if found is None else found[0].get('holder', '?')

    def _start_renewing(self) -> None:
        self._renewer = threading.Thread(target=self._renew_every, name='vrl-lease', daemon=True)
        self._renewer.start()

    def _renew_every(self) -> None:
        """Renews every stale_after / 4 s, or every request timeout T of the store if shorter (the
        renewals are what notices a store that stopped answering): each renewal is given up after T,
        and renewals that have failed for 2 T end the process (`store_gone`), whatever its main
        thread is waiting on. A shorter outage is retried (`confirm` decides whether a write may go)."""
        timeout = storage.request_timeout_s()
        failing_since = None
        while not self._stop.wait(min(self.stale_after / 4, timeout)) and not self.lost:
            started = self._clock()
            try:
                storage.within(timeout, self.renew)
                failing_since = None
            except Exception as e:  # noqa: BLE001 - a passing outage, until it lasts
                failing_since = started if failing_since is None else failing_since
                cause = ' '.join(f'{type(e).__name__}: {e}'.split()).rstrip(': ')
                if self._clock() - failing_since >= 2 * timeout and not self._stop.is_set():
                    self.store_gone(f'the object store stopped answering: renewing the lease {self.path} failed '
                                    f'for {self._clock() - failing_since:.0f} s ({cause}; VRL_STORE_TIMEOUT_S='
                                    f'{timeout:g}). This {self.holder_kind} stops here, its last checkpoint intact: '
                                    'run the same command once the store answers.')
                logging.warning('renewing the lease of workdir %s failed (%s); retrying', self.path.parent, cause)

    def renew(self) -> None:
        """One conditional rewrite; a lease found changed is lost (`lost` says why)."""
        with self._lock:
            self._rewrite()

    def commit(self, step: int | None = None, logged_bytes: int | None = None) -> None:
        """Makes checkpoint `step` of this epoch, or the first `logged_bytes` of its metrics file,
        readable, with the renewal's conditional rewrite; LeaseLostError if this run no longer holds
        the lease (what it wrote stays unread). Committed steps whose folders are gone are dropped."""
        with self._lock:
            if step is not None:
                kept = steps_in(self.path.parent / 'checkpoints')
                self.committed = {s: e for s, e in self.committed.items() if step_name(s, e) in kept} | {step: self.epoch}
            if logged_bytes is not None:
                self.logged = {**self.logged, self.epoch: logged_bytes}
            if not self._rewrite():
                raise LeaseLostError(f'{self.lost}: this {self.holder_kind} stopped without making more of what it '
                                     'wrote readable; its last committed checkpoint is intact.')

    def _rewrite(self) -> bool:
        """Writes the record over the generation this run last wrote; whether it still holds the lease
        (if not, `lost` says why)."""
        if self.lost or self._write(self._generation):
            return not self.lost
        found = self._read()  # changed: by a retried write of ours that had landed, or by a taker
        if found is not None and found[0].get('token') == self.token and not found[0].get('released'):
            self._generation = found[1]
            if self._write(self._generation):
                return True
            found = self._read()
        self.lost = (f'the lease of workdir {self.path.parent} was taken over by '
                     f'{(found or ({"holder": "nobody (deleted)"}, 0))[0].get("holder")}')
        logging.error('%s; this run writes nothing more there', self.lost)
        return False

    def confirm(self) -> None:
        """Returns if this run surely still holds the lease: a write may follow. LeaseLostError if not."""
        if not self.lost and self._clock() - self._renewed_at > self.stale_after / 2:
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - unrenewable: another run may take the lease over soon
                self.lost = (f'the lease of workdir {self.path.parent} could not be renewed for '
                             f'{self._clock() - self._renewed_at:.0f} s ({e})')
        if self.lost:
            raise LeaseLostError(f'{self.lost}: another {self.holder_kind} may be writing there, so this one '
                                 'stopped without writing more; its last checkpoint is intact.')

    def release(self) -> None:
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        with self._lock:
            if self.lost:
                return
            try:
                storage.write_if(self.path, self._record(released=True), self._generation)
            except Exception as e:  # noqa: BLE001 - unreleased, the lease is taken over once stale
                logging.warning('releasing the lease of workdir %s failed (%s)', self.path.parent, e)


@dataclasses.dataclass(frozen=True)
class Fence:
    """What a workdir's lease record makes readable: the latest `epoch`, its committed checkpoint
    steps (step -> epoch) and each epoch's readable metrics bytes."""
    epoch: int = 0
    committed: dict[int, int] = dataclasses.field(default_factory=dict)
    logged: dict[int, int] = dataclasses.field(default_factory=dict)


def read_fence_record(record: dict[str, Any]) -> Fence:
    """The fence of a lease record (JSON keys are strings); a record from before fencing has none."""
    return Fence(int(record.get('epoch', 0)), {int(k): int(v) for k, v in record.get('committed', {}).items()},
                 {int(k): int(v) for k, v in record.get('logged', {}).items()})


def read_fence(workdir: epath.Path) -> Fence:
    """The fence of the lease at `workdir` (a remote workdir's; none elsewhere or before a run)."""
    if not storage.is_remote(workdir):
        return Fence()
    found = storage.read_versioned(workdir / '.lock') if str(workdir).startswith(('gs://', 'gcs://')) else None
    try:
        return read_fence_record(json.loads(found[0])) if found else Fence()
    except (ValueError, AttributeError):  # a local flock file copied up: no lease
        return Fence()


def step_name(step: int | str, epoch: int | str) -> str:
    """The folder name of checkpoint `step` saved in lease `epoch` on an object store."""
    return f'{step}.e{epoch}'


def metrics_file(epoch: int | str) -> str:
    """The metrics file of a run of lease `epoch` in an object-store workdir ('*': a glob of them all)."""
    return f'metrics.e{epoch}.jsonl'


def steps_in(folder: epath.Path) -> set[str]:
    """The names of the entries of checkpoint folder `folder` (none if it is not there yet)."""
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def elapsed_seconds() -> float:
    """Seconds on a clock that also counts while the machine is suspended (CLOCK_BOOTTIME, on Linux;
    elsewhere the monotonic clock): a VM suspended past a lease's staleness finds it stale on
    waking, rather than writing as its holder."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, 'CLOCK_BOOTTIME') else time.monotonic()


def take(guard: Lock | Lease) -> None:
    """Creates the guard's workdir and proves it writable (StorageError in one line naming the path
    and what to do, before anything is compiled or written), then takes the guard; a stale lease taken
    over is said on stdout."""
    workdir = guard.path.parent
    existed = storage.is_remote(workdir) or workdir.exists()  # a bucket has no folders: empty is new
    storage.check_writable(workdir, '--workdir')
    created = not existed or (storage.is_remote(workdir) and not storage.files(workdir))
    if taken_over := guard.acquire():
        print(taken_over, flush=True)
    guard.created = created


def let_go(guard: Lock | Lease) -> None:
    """Releases the guard; a workdir that `take` created and that holds nothing else is removed (a
    run refused before it wrote anything leaves no trace)."""
    guard.release()
    workdir = guard.path.parent
    if guard.created and set(storage.files(workdir)) <= {guard.path.name}:
        storage.delete(guard.path)
        if not storage.is_remote(workdir):
            workdir.rmdir()
        guard.created = False


def make_guard(workdir: epath.Path, holder_kind: str = 'run', stale_after: float = 300.0,
         take_over: bool = False) -> Lock | Lease:
    """The guard that keeps a second writer out of `workdir`: a flock locally, a lease on an object
    store (`take_over`: at once, from a holder known to be gone)."""
    if storage.is_remote(workdir) and not str(workdir).startswith(('gs://', 'gcs://')):
        raise WorkdirError(f'{workdir}: a workdir on an object store is kept by a lease on GCS object generations, '
                           'which this store does not have; use a gs:// or a local path.')
    if storage.is_remote(workdir):
        return Lease(workdir, holder_kind, stale_after, take_over)
    return Lock(workdir, holder_kind)


def _read_record(workdir: epath.Path) -> dict[str, Any] | None:
    try:
        return json.loads((workdir / 'config.json').read_text())
    except (OSError, ValueError):
        return None


def _run_files(workdir: epath.Path) -> list[str]:
    """The names in `workdir` that hold its run (on an object store: each lease epoch's metrics too)."""
    return [name for name in RUN_FILES if (workdir / name).exists()] + [p.name for p in workdir.glob(metrics_file('*'))]


def start_over(workdir: epath.Path, config: Config, latest_step: int | None) -> str:
    """`--fresh`: moves the workdir's run aside, unless it is the unfinished run that `--fresh`
    started with this same config (then it resumes). Returns what was done, for the log."""
    record = _read_record(workdir)
    if (record is not None and record.get('started_fresh') and record.get('config') == as_json(config)
            and latest_step is not None and latest_step < config.train.steps):
        return (f'--fresh: resuming the run that --fresh started at {record.get("started", "?")} with this '
                f'config (step {latest_step}); to start over again, change the command or workdir')
    names = _run_files(workdir)
    if not names:
        return '--fresh: the workdir holds no run'
    target = workdir / 'previous_runs' / time.strftime('%Y%m%dT%H%M%S')
    target.mkdir(parents=True)
    for name in names:
        storage.move(workdir / name, target / name)
    return f'--fresh: moved the previous run to {target}'


def kept_tokenizer(workdir: epath.Path, source: epath.Path) -> epath.Path | None:
    """The workdir's copy of the tokenizer `source` names, if the workdir holds a run, which trained with it."""
    kept = workdir / source.name
    return kept if kept.exists() and (workdir / 'checkpoints').exists() else None


def keep_tokenizer(workdir: epath.Path, source: epath.Path, chosen: str) -> str:
    """Copies the tokenizer a run starts with (and a tokenizer.json's tokenizer_config.json, which
    names its special tokens) into the workdir, unless the workdir's run already has one (a resume
    keeps the tokenizer it trained with); returns the line for the log."""
    if kept := kept_tokenizer(workdir, source):
        return f'{chosen}: the workdir keeps the one its run trained with, {kept}'
    kept = workdir / source.name
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
