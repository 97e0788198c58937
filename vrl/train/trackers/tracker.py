"""The interface every destination of a run's records implements."""

from __future__ import annotations

from typing import Any


class Tracker:
    """A destination of a run's records. A record is {'step': S, name: number, ...}; diagnostics
    are {statistic: [one value per layer, None where a layer has none]}."""

    def log(self, step: int, record: dict[str, Any]) -> None:
        """One record of step `step` (training metrics, or an evaluation's)."""

    def log_diagnostics(self, step: int, diagnostics: dict[str, list[float | None]]) -> None:
        """The per-layer statistics of step `step`."""

    def mark_start(self, step: int, how: str, details: dict[str, Any]) -> None:
        """A run (re)started at `step` ('started' or 'resumed'): later records of a step supersede earlier ones."""

    def flush(self) -> None:
        """What was logged so far reaches this tracker's files."""

    def close(self) -> None:
        """No more records."""
