"""metrics.jsonl: one JSON object per line, appended and flushed at every record."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vrl.train.trackers.tracker import Tracker


class JsonlTracker(Tracker):
    def __init__(self, folder: Path):
        self._file = open(Path(folder) / 'metrics.jsonl', 'a')

    def _line(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + '\n')
        self._file.flush()

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._line(record)

    def log_diagnostics(self, step: int, diagnostics: dict[str, list[float | None]]) -> None:
        self._line({'step': step, 'diagnostics': diagnostics})

    def mark_start(self, step: int, how: str, details: dict[str, Any]) -> None:
        self._line(
            {
                'step': step,
                'event': how,
                'time': time.strftime('%Y-%m-%d %H:%M:%S'),
                **{k: v for k, v in details.items() if v},
            }
        )

    def close(self) -> None:
        self._file.close()
