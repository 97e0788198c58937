"""metrics.jsonl: one JSON object per line, appended and flushed at every record.

A process killed mid-write leaves half a line at the end. Opening the file to append finds it and
moves it to TORN_FILE first, so that every line the run appends is a whole record; readers
(`records`) skip a line that does not parse, with one warning naming the file, and read the rest.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

from vrl.train.rundir.workdir import TORN_METRICS as TORN_FILE  # the torn ends set aside, one per line
from vrl.train.trackers.tracker import Tracker


class JsonlTracker(Tracker):
    def __init__(self, folder: Path, say: Callable[[str], None] = print):
        """Appends to `folder`/metrics.jsonl; a torn last line there is set aside first (`say` tells it)."""
        path = Path(folder) / 'metrics.jsonl'
        torn = set_aside_torn_end(path)
        if torn:
            say(
                f'{path} ended in half a record ({torn} bytes: the last run stopped while writing it); '
                f'moved to {path.with_name(TORN_FILE)}, and the records before it are kept'
            )
        self._file = open(path, 'a')

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
                **{k: v for k, v in details.items() if v is not None},
            }
        )

    def close(self) -> None:
        self._file.close()


def set_aside_torn_end(path: Path) -> int:
    """Moves the bytes after the last newline of `path` (a record cut off mid-write) to TORN_FILE beside
    it, appended as one line, and truncates `path` to its whole records; how many bytes were moved."""
    if not path.exists():
        return 0
    with open(path, 'rb+') as f:
        size = f.seek(0, 2)
        tail = 0
        while tail < size:  # scan back from the end for the last newline, a block at a time
            step = min(65536, size - tail)
            f.seek(size - tail - step)
            block = f.read(step)
            newline = block.rfind(b'\n')
            if newline >= 0:
                tail += step - newline - 1
                break
            tail += step
        if not tail:
            return 0
        f.seek(size - tail)
        torn = f.read(tail)
        with open(path.with_name(TORN_FILE), 'ab') as aside:
            aside.write(torn + b'\n')
        f.truncate(size - tail)
    return tail


def records(text: str, where: str) -> list[dict]:
    """The records of metrics text read from `where`; a line that is not a JSON object (a record cut
    off by a crash) is left out, with one warning naming the file and the line."""
    out, bad = [], []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and 'step' in record:
            out.append(record)
        elif line.strip():
            bad.append(number)
    if bad:
        logging.warning(
            '%s: line %s is not a whole record (a run stopped mid-write), skipped; the other %d records are read',
            where,
            ', '.join(map(str, bad)),
            len(out),
        )
    return out
