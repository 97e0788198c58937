"""A workdir's run record: starting over keeps the old run, restarts are recorded, a tokenizer
that came with Hugging Face weights is kept beside the run. (Who may write a workdir:
vrl/train/rundir/guard.py.)

- `start_over`: what `--fresh` does. The old run (checkpoints, metrics, config.json,
  TensorBoard) moves to `WORKDIR/previous_runs/<time>/`; nothing is deleted. A run that
  `--fresh` started keeps resuming under the same command (and config) until it finishes, so
  "run the same command to resume" holds after a preemption.
- `record_start`: config.json holds the current config and, under `history`, every start:
  its step and what changed since the previous one.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from etils import epath

from vrl.core import storage
from vrl.core.errors import VrlError
from vrl.model.config import upgraded
from vrl.train.config import Config

# the tokenizer a run started from Hugging Face weights came with (with a tokenizer.json, its config)
TOKENIZER_FILES = ('tokenizer.model', 'tokenizer.json', 'tokenizer_config.json')
WANDB_RUN_ID = 'wandb_run_id'  # the W&B run this workdir's run logs to (vrl/train/trackers/wandb.py)
TORN_METRICS = 'metrics.torn.txt'  # a crash's half-written records, set aside (vrl/train/trackers/jsonl.py)
RUN_FILES = ('checkpoints', 'metrics.jsonl', TORN_METRICS, 'config.json', 'tensorboard', *TOKENIZER_FILES, WANDB_RUN_ID)


class WorkdirError(VrlError, RuntimeError):
    """The workdir cannot be used as asked; the message says why and what to do."""


class NotARunError(VrlError, FileNotFoundError):
    """A folder given as a run's workdir holds no run record (config.json)."""


def step_name(step: int | str, epoch: int | str) -> str:
    """The folder name of checkpoint `step` saved in lease `epoch` on an object store."""
    return f'{step}.e{epoch}'


def step_of(name: str) -> tuple[int, int] | None:
    """(step, epoch) of a step folder's name: STEP (epoch 0) or STEP.eEPOCH; None for another name."""
    step, _, epoch = name.partition('.e')
    return (int(step), int(epoch or 0)) if step.isdigit() and (not epoch or epoch.isdigit()) else None


COMMITTED = 'commit_success.txt'  # the object Orbax writes last into a step saved on an object store


def metrics_file(epoch: int | str) -> str:
    """The metrics file of a run of lease `epoch` in an object-store workdir ('*': a glob of them all)."""
    return f'metrics.e{epoch}.jsonl'


def steps_in(folder: epath.Path) -> set[str]:
    """The names of the entries of checkpoint folder `folder` (none if it is not there yet), listed anew."""
    return storage.names(folder)


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
    if (
        record is not None
        and record.get('started_fresh')
        and record.get('config') == as_json(config)
        and latest_step is not None
        and latest_step < config.train.steps
    ):
        return (
            f'--fresh: resuming the run that --fresh started at {record.get("started", "?")} with this '
            f'config (step {latest_step}); to start over again, change the command or workdir'
        )
    names = _run_files(workdir)
    if not names:
        return '--fresh: the workdir holds no run'
    target = workdir / 'previous_runs' / time.strftime('%Y%m%dT%H%M%S')
    target.mkdir(parents=True)
    for name in names:
        storage.move(workdir / name, target / name)
    return f'--fresh: moved the previous run to {target}'


def trained_tokenizer(workdir: epath.Path, source: epath.Path) -> epath.Path | None:
    """The workdir's copy of the tokenizer `source` names, which its run trained with (None: no run
    there, or no copy)."""
    kept = workdir / source.name
    return kept if kept.exists() and (workdir / 'checkpoints').exists() else None


def copy_tokenizer(workdir: epath.Path, source: epath.Path, chosen: str) -> str:
    """Copies the tokenizer a run starts with (and a tokenizer.json's tokenizer_config.json, which
    names its special tokens) into the workdir, unless the workdir's run already has one (a resume
    keeps the tokenizer it trained with); returns the line for the log."""
    if kept := trained_tokenizer(workdir, source):
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
    """'section.field' -> [old, new] for each field of `new` (an as_json config) that differs in `old`.
    A field that `old` lacks (a record from before vrl had it) counts as its default; a model section from
    before model.residual is read as today's (model.config.upgraded)."""
    defaults = as_json(Config())
    if 'model' in old:
        old = {**old, 'model': upgraded(old['model'])}
    return {
        f'{section}.{key}': [old.get(section, {}).get(key), value]
        for section, values in new.items()
        for key, value in values.items()
        if old.get(section, {}).get(key, defaults[section].get(key)) != value
    }


def last_read(workdir: epath.Path) -> dict[str, Any] | None:
    """What the run in `workdir` read at its last start (pipeline.provenance), if recorded."""
    return (_read_record(workdir) or {}).get('data')


def record_start(
    workdir: epath.Path, config: Config, step: int, fresh: bool, extra: dict[str, Any], source: dict[str, Any]
) -> dict[str, list]:
    """Writes config.json for a start at `step` (its history entry with `source`: what --init_from read, if
    anything) and returns the settings changed since the last start."""
    record = _read_record(workdir) or {}
    new = as_json(config)
    changed = changes(record['config'], new) if step and 'config' in record else {}
    history = record.get('history', []) + [
        {'step': step, 'time': time.strftime('%Y-%m-%d %H:%M:%S'), 'changed': changed, **source}
    ]
    started_fresh = record.get('started_fresh', False) if step else fresh
    started = record.get('started', history[-1]['time']) if step else history[-1]['time']
    storage.write_bytes(
        workdir / 'config.json',
        json.dumps(
            {'config': new, **extra, 'started_fresh': started_fresh, 'started': started, 'history': history}, indent=2
        ).encode(),
    )
    return changed
