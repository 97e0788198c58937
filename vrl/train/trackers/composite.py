"""`Trackers`: what a run writes its records to, on process 0; elsewhere nothing.

A local workdir's files are written in place. An object-store workdir's are written in local
scratch and sent by `StoredLog` at each `flush` (the loop flushes at every checkpoint and
evaluation) and at most FLUSH_SECONDS after a record.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from etils import epath

from vrl.core import storage
from vrl.train.config import Config
from vrl.train.rundir import guard as guard_lib
from vrl.train.trackers.jsonl import JsonlTracker
from vrl.train.trackers.stored import StoredLog
from vrl.train.trackers.tensorboard import TensorBoardTracker
from vrl.train.trackers.terminal import TerminalTracker
from vrl.train.trackers.tracker import Tracker

FLUSH_SECONDS = 60.0  # an object-store workdir's records reach the store at most this long after one


class Trackers:
    """metrics.jsonl, TensorBoard, the terminal and (train.wandb_project) W&B, written together."""

    def __init__(self, trackers: list[Tracker], terminal: TerminalTracker | None, stored: StoredLog | None):
        self._trackers, self._terminal, self._stored = trackers, terminal, stored

    @classmethod
    def open(
        cls,
        workdir: str | epath.Path,
        total_steps: int,
        start_step: int,
        enabled: bool,
        label: str,
        guard: guard_lib.Guard,
        wandb: tuple[Config, dict[str, Any]] | None = None,
        print_every: int = 0,
    ) -> 'Trackers':
        """The run's trackers in `workdir` (none unless `enabled`: process 0); `label` starts every
        terminal line; `guard` (the workdir's Lock or Lease) is confirmed before each upload to an
        object store; `wandb`: (the config, what the run reads) for a W&B run; `print_every`: the
        terminal's training lines (TerminalTracker)."""
        if not enabled:
            return cls([], None, None)
        workdir = storage.path(workdir)
        stored = StoredLog(workdir, guard) if storage.is_remote(workdir) else None
        folder = stored.local if stored else workdir
        terminal = TerminalTracker(total_steps, start_step, label, print_every)
        trackers: list[Tracker] = [JsonlTracker(folder, terminal.print), TensorBoardTracker(folder, start_step)]
        if wandb is not None:
            from vrl.train.trackers.wandb import WandbTracker

            trackers.append(WandbTracker(wandb[0], workdir, wandb[1]))
        return cls(trackers + [terminal], terminal, stored)

    def write(self, step: int, record: dict[str, Any]) -> None:
        record = {'step': step, **{k: _plain(v) for k, v in record.items()}}
        for tracker in self._trackers:
            tracker.log(step, record)
        self._flush_if_due()

    def write_diagnostics(self, step: int, diagnostics: dict[str, list[float | None]]) -> None:
        for tracker in self._trackers:
            tracker.log_diagnostics(step, diagnostics)
        self._flush_if_due()

    def mark_start(self, step: int, how: str, **details: Any) -> None:
        for tracker in self._trackers:
            tracker.mark_start(step, how, details)

    def print(self, line: str) -> None:
        if self._terminal is not None:
            self._terminal.print(line)

    def _flush_if_due(self) -> None:
        if self._stored is not None and time.monotonic() - self._stored.last_flush > FLUSH_SECONDS:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Puts what was written so far on the store (an object-store workdir): in the background, or
        with `wait` before returning."""
        if self._stored is not None:
            for tracker in self._trackers:
                tracker.flush()
            self._stored.flush(wait)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
        if self._stored is not None:
            self._stored.close()


def _plain(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return value.item()
    return value
