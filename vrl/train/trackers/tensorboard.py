"""TensorBoard event files: a chart per number, and per diagnostic statistic a chart with a line per layer."""

from __future__ import annotations

import math
import sys
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


class TensorBoardTracker(Tracker):
    def __init__(self, folder: Path, start_step: int):
        SummaryWriter = _summary_writer()  # a resumed run's points after its checkpoint replace the earlier
        self._writer = SummaryWriter(
            str(Path(folder) / 'tensorboard'), purge_step=start_step + 1 if start_step else None
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        for key, value in record.items():  # a skipped step's NaN stays in metrics.jsonl, out of TensorBoard
            if key != 'step' and isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)

    def log_diagnostics(self, step: int, diagnostics: dict[str, list[float | None]]) -> None:
        for name, values in diagnostics.items():
            self._writer.add_scalars(f'diagnostics/{name}', layer_stats.by_layer(name, values), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
