"""Weights & Biases, optional: everything a run writes to metrics.jsonl, also in a W&B run.

On when `train.wandb_project` is set (wandb from requirements-extra.txt); process 0 logs. One W&B
run per workdir: its id is kept in WORKDIR/wandb_run_id, so a resumed run continues the same W&B
run (and `--fresh`, which moves the workdir's run aside, starts a new one). W&B's step is the
training step; the steps a resumed run trains again after its checkpoint were logged by the
interrupted attempt already, and W&B keeps those first values (equal ones, for a deterministic
run). `WANDB_MODE=offline` writes the run under WANDB_DIR for `wandb sync` later.
"""

from __future__ import annotations

import uuid
from typing import Any

from etils import epath

from vrl.core import storage
from vrl.core.errors import VrlError
from vrl.model import layer_stats
from vrl.train.config import Config
from vrl.train.rundir import workdir as workdir_lib
from vrl.train.trackers.tracker import Tracker


class TrackingError(VrlError, ImportError):
    """W&B was asked for but cannot be used; the message says what to install."""


class WandbTracker(Tracker):
    """The workdir's W&B run, started (or resumed) with the run's config and `extra` (what it reads)."""

    def __init__(self, config: Config, workdir: epath.Path, extra: dict[str, Any] | None = None):
        try:
            import wandb
        except ImportError:
            raise TrackingError(
                'train.wandb_project is set but wandb is not installed: pip install -r requirements-extra.txt'
            ) from None
        id_file = workdir / workdir_lib.WANDB_RUN_ID
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        if not id_file.exists():
            storage.write_bytes(id_file, run_id.encode())
        train = config.train
        self._run = wandb.init(
            project=train.wandb_project,
            entity=train.wandb_entity or None,
            name=train.wandb_run_name or workdir.name,
            id=run_id,
            resume='allow',
            config={**workdir_lib.as_json(config), **(extra or {})},
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        values = {k: v for k, v in record.items() if k != 'step' and isinstance(v, (int, float))}
        if values:
            self._run.log(values, step=step)

    def log_diagnostics(self, step: int, diagnostics: dict[str, list[float | None]]) -> None:
        """Each diagnostic as diagnostics/<statistic>/layer_<i>."""
        self._run.log(
            {
                f'diagnostics/{name}/{layer}': v
                for name, per_layer in diagnostics.items()
                for layer, v in layer_stats.by_layer(name, per_layer).items()
            },
            step=step,
        )

    def close(self) -> None:
        self._run.finish()
