"""The workdir's guards: one run writes it, starting over keeps the old run, restarts are recorded.

- `Lock`: an exclusive `flock` on `WORKDIR/.lock`, taken by process 0 of a run (all processes
  of one run share the workdir). The kernel drops it when the holder dies, kill -9 and a lost
  VM included, so a stale lock never blocks; the file names the holder for the refusal.
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
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from vrl.config import Config
from vrl.errors import VrlError

TOKENIZER = 'tokenizer.model'  # the tokenizer a run started from Hugging Face weights came with
RUN_FILES = ('checkpoints', 'metrics.jsonl', 'config.json', 'tensorboard', TOKENIZER)


class WorkdirError(VrlError, RuntimeError):
    """The workdir cannot be used as asked; the message says why and what to do."""


class NotARunError(VrlError, FileNotFoundError):
    """A folder given as a run's workdir holds no run record (config.json)."""


class Lock:
    """Held from `acquire` until `release` or the process's death."""

    def __init__(self, workdir: Path, holder_kind: str = 'run'):
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
        os.write(fd, f'host {socket.gethostname()}, pid {os.getpid()}, since '
                     f'{time.strftime("%Y-%m-%d %H:%M:%S")}'.encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_record(workdir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((workdir / 'config.json').read_text())
    except (OSError, ValueError):
        return None


def _has_run(workdir: Path) -> bool:
    return any((workdir / name).exists() for name in RUN_FILES)


def start_over(workdir: Path, config: Config, latest_step: int | None) -> str:
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
            (workdir / name).rename(target / name)
    return f'--fresh: moved the previous run to {target}'


def keep_tokenizer(workdir: Path, source: Path, chosen: str) -> str:
    """Copies the tokenizer a run starts with into the workdir, unless the workdir's run already has
    one (a resume keeps the tokenizer it trained with); returns the line for the log."""
    kept = workdir / TOKENIZER
    if kept.exists() and (workdir / 'checkpoints').exists():
        return f'{chosen}: the workdir keeps the one its run trained with, {kept}'
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, kept)
    return f'{chosen}, copied to {kept}'


def as_json(config: Config) -> dict[str, Any]:
    """The config as config.json stores it (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """'section.field' -> [old, new] for each field of `new` (an as_json config) that differs in `old`."""
    return {f'{section}.{key}': [old.get(section, {}).get(key), value]
            for section, values in new.items() for key, value in values.items()
            if old.get(section, {}).get(key) != value}


def record_start(workdir: Path, config: Config, step: int, fresh: bool, extra: dict[str, Any]) -> dict[str, list]:
    """Writes config.json for a start at `step` and returns the settings changed since the last start."""
    record = _read_record(workdir) or {}
    new = as_json(config)
    changed = changes(record['config'], new) if step and 'config' in record else {}
    history = record.get('history', []) + [{'step': step, 'time': time.strftime('%Y-%m-%d %H:%M:%S'),
                                            'changed': changed}]
    started_fresh = record.get('started_fresh', False) if step else fresh
    started = record.get('started', history[-1]['time']) if step else history[-1]['time']
    (workdir / 'config.json').write_text(json.dumps(
        {'config': new, **extra, 'started_fresh': started_fresh, 'started': started, 'history': history},
        indent=2))
    return changed
