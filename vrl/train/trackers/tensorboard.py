"""TensorBoard event files: a chart per number, and per diagnostic statistic a chart with a line per layer."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Any

from vrl.model import layer_stats
from vrl.train.trackers.tracker import Tracker


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported with torch out of sight unless a module of this process
    loaded it already: tensorboardX imports torch wherever it is installed (Colab, the test install),
    for a tensor type vrl never hands it (2.3 s of a run's start on 2 cores, against 0.5 s without)."""
    hidden = 'torch' not in sys.modules
    if hidden:
        sys.modules['torch'] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hidden:
            del sys.modules['torch']
    return SummaryWriter


QUEUED_EVENTS = 10_000  # a writer's queue: never full while its thread lives, so an add never blocks


class _WriterFailures:
    """What killed tensorboardX's writer threads (each writes its queue's events to a file: a full disk
    ends it with an OSError), by thread: the exception is kept here instead of printed, for the tracker
    to raise in the training thread."""

    def __init__(self):
        self.by_thread: dict[threading.Thread, BaseException] = {}
        self._previous = threading.excepthook
        threading.excepthook = self._hook

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        from tensorboardX.event_file_writer import _EventLoggerThread

        if isinstance(args.thread, _EventLoggerThread) and args.exc_value is not None:
            self.by_thread[args.thread] = args.exc_value
            return
        self._previous(args)


_failures: _WriterFailures | None = None


class TensorBoardTracker(Tracker):
    def __init__(self, folder: Path, start_step: int):
        global _failures
        _failures = _failures or _WriterFailures()
        SummaryWriter = _summary_writer()  # a resumed run's points after its checkpoint replace the earlier
        self._writer = SummaryWriter(
            str(Path(folder) / 'tensorboard'),
            purge_step=start_step + 1 if start_step else None,
            max_queue=QUEUED_EVENTS,
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._check()
        for key, value in record.items():  # a skipped step's NaN stays in metrics.jsonl, out of TensorBoard
            if key != 'step' and isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)

    def log_diagnostics(self, step: int, diagnostics: dict[str, list[float | None]]) -> None:
        self._check()
        for name, values in diagnostics.items():
            self._writer.add_scalars(f'diagnostics/{name}', layer_stats.by_layer(name, values), step)

    def flush(self) -> None:
        self._check()
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def _check(self) -> None:
        """Raises what stopped a writer thread of this tracker (an OSError naming the file, e.g. no space
        left on the device), so that the run ends with it rather than waiting on a queue nobody reads.
        (tensorboardX's FileWriter.event_writer._worker is the thread; tests/test_trackers.py holds it.)"""
        for file_writer in (self._writer.all_writers or {}).values():
            worker = file_writer.event_writer._worker
            if worker is not None and not worker.is_alive() and worker in _failures.by_thread:
                failure = _failures.by_thread[worker]
                if isinstance(failure, OSError) and not failure.filename:  # a file's write names no file
                    raise OSError(failure.errno, failure.strerror, file_writer.get_logdir()) from failure
                raise failure
