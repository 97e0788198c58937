"""A grid's results as data: DIR/results.jsonl, one JSON line per finished run, apart from its workdir.

A row is a run's result (vrl/experiments/grid.py: variant, seed, coordinates, peak LR, steps, the final
eval loss and the curves the reports draw, seconds, FLOPs, ...) with what identifies and places it:

- `fingerprint`: a digest of the run's config without the fields that say where or how it ran
  (WHERE_AND_HOW: paths, logging and checkpoint cadences, the mesh, execution settings), so the same
  grid point has the same fingerprint on every machine;
- `differs`: the config's fields whose values differ from the grid's base config;
- `tokens`, `final_train_loss`, `step_seconds` (the median logged), `peak_memory_bytes` and what that
  peak is of, `machine`, `commit` (the code's), `recorded` (when the row was written).

Rows are only appended. A run whose row is here is not trained again, even when its workdir is gone,
and the reports are made from the rows. Ledgers of two halves of a grid (two machines, two sittings)
merge by concatenation (`cat a/results.jsonl >> b/results.jsonl`): reading keeps one row per
fingerprint, and two rows of one fingerprint with different losses are one warning naming both (the
first is used).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import resource
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from etils import epath

from vrl.core import storage
from vrl.model.config import EXECUTION_FIELDS, before_residual
from vrl.train import metrics
from vrl.train.config import Config
from vrl.train.rundir import workdir as workdir_lib

LEDGER = 'results.jsonl'
# config fields that say where or how a run ran, not what it computes: left out of its fingerprint
WHERE_AND_HOW = frozenset(
    {
        'data.data_dir',
        'data.tokenizer',
        'data.num_workers',
        'data.read_threads',
        'data.prefetch',
        'train.print_every',
        'train.checkpoint_every',
        'train.checkpoint_minutes',
        'train.keep_checkpoints',
        'train.keep_period',
        'train.peak_flops',
        'train.lease_stale_seconds',
        'train.microbatches',
        'train.wandb_project',
        'train.wandb_entity',
        'train.wandb_run_name',
        'train.downstream_include_path',
        *(f'model.{name}' for name in EXECUTION_FIELDS),
    }
)


# config fields added after ledgers began: left out of a fingerprint where they hold their default, so that
# the rows written before them still name the same runs (tests/test_ledger.py holds the default config's
# fingerprint fixed: a new field goes here, with a default that computes what runs computed before it)
ADDED_AFTER_LEDGERS = frozenset({'train.init_value_heads'})


@functools.cache
def _default_json() -> dict:
    """The default config's JSON, made once (every fingerprint compares its ADDED_AFTER_LEDGERS fields to it)."""
    return workdir_lib.as_json(Config())


def fingerprint(config: Config) -> str:
    """16 hex digits of the SHA-256 of the config's JSON (sorted keys) without WHERE_AND_HOW, the mesh and the
    fields ADDED_AFTER_LEDGERS at their defaults, the residual method spelled as before model.residual."""
    values, defaults = workdir_lib.as_json(config), _default_json()
    values.pop('mesh', None)
    values['model'] = before_residual(values['model'])  # the fields the first ledgers were written with
    kept = {
        section: {
            k: v
            for k, v in fields.items()
            if f'{section}.{k}' not in WHERE_AND_HOW
            and not (f'{section}.{k}' in ADDED_AFTER_LEDGERS and v == defaults[section][k])
        }
        for section, fields in values.items()
    }
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


# what a row holds beside the run's result
PLACEMENT = (
    'fingerprint',
    'name',
    'differs',
    'tokens',
    'final_train_loss',
    'step_seconds',
    'peak_memory_bytes',
    'peak_memory_of',
    'machine',
    'commit',
    'recorded',
)


def result_of(row: dict[str, Any]) -> dict[str, Any]:
    """The run's result (vrl/experiments/grid.py) that a row holds."""
    return {k: v for k, v in row.items() if k not in PLACEMENT}


def row(name: str, config: Config, base: Config, result: dict[str, Any]) -> dict[str, Any]:
    """The ledger row of finished run `name`: its `result` with what identifies and places it."""
    steps = sorted(result['train_loss'], key=int)
    differs = workdir_lib.changes(workdir_lib.as_json(base), workdir_lib.as_json(config))
    peak, peak_of = _peak_memory()
    return {
        'fingerprint': fingerprint(config),
        'name': name,
        'differs': {name: new for name, (_, new) in differs.items() if name not in WHERE_AND_HOW},
        **result,
        'tokens': result['step'] * result['tokens_per_step'],
        'final_train_loss': result['train_loss'][steps[-1]] if steps else None,
        'step_seconds': _step_seconds(result),
        'peak_memory_bytes': peak,
        'peak_memory_of': peak_of,
        'machine': machine(),
        'commit': commit(),
        'recorded': time.strftime('%Y-%m-%d %H:%M:%S'),
    }


class Ledger:
    """DIR/results.jsonl of one grid directory; `base`: the grid's base config (for each row's `differs`)."""

    def __init__(self, folder: epath.Path, base: Config):
        self.path, self.base = folder / LEDGER, base
        self._rows: dict[str, dict[str, Any]] | None = None

    def rows(self) -> dict[str, dict[str, Any]]:
        """The rows by fingerprint, read once (see `read`)."""
        if self._rows is None:
            self._rows = read(self.path)
        return self._rows

    def held(self, config: Config) -> dict[str, Any] | None:
        """The row of the run of `config`, if the ledger has one."""
        return self.rows().get(fingerprint(config))

    def record(self, name: str, config: Config, result: dict[str, Any]) -> None:
        """Appends run `name`'s row unless the ledger holds the same one (process 0 only)."""
        new = row(name, config, self.base, result)
        held = self.held(config)
        if held is not None and _outcome(held) == _outcome(new) and held.get('downstream') == new.get('downstream'):
            return
        if jax.process_index() == 0:
            line = (json.dumps(new) + '\n').encode()
            storage.append(self.path, line, new=not storage.exists(self.path, 'the ledger'))
        self.rows()[new['fingerprint']] = new


def read(path: epath.Path) -> dict[str, dict[str, Any]]:
    """The rows of ledger `path` by fingerprint ({} where there is none): for a fingerprint written twice,
    the first row, with the later one's downstream scores merged in where its losses are the same; where
    they differ, one warning naming both. A line that is not a row (cut off by a crash) is skipped, with
    a warning naming the file and the line."""
    if not storage.exists(path, 'the ledger'):
        return {}
    rows: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            new = json.loads(line)
        except ValueError:
            new = None
        if not isinstance(new, dict) or 'fingerprint' not in new:
            if line.strip():
                logging.warning('%s: line %d is not a ledger row (cut off by a crash?), skipped', path, number)
            continue
        held = rows.get(new['fingerprint'])
        if held is None:
            rows[new['fingerprint']] = new
        elif _outcome(held) == _outcome(new):
            held['downstream'] = {**held.get('downstream', {}), **new.get('downstream', {})}
        else:
            logging.warning(
                '%s: run %s (%s) has two results: eval loss %.6f (%s, %s, %s) and %.6f (%s, %s, %s); the first is used',
                path,
                held.get('name'),
                held['fingerprint'],
                held['eval_loss'],
                _where(held),
                held.get('commit'),
                held.get('recorded'),
                new['eval_loss'],
                _where(new),
                new.get('commit'),
                new.get('recorded'),
            )
    return rows


def _outcome(row: dict[str, Any]) -> tuple:
    """What two rows of one run must agree on to be the same result."""
    return row['eval_loss'], row.get('final_train_loss'), row['step']


def _where(row: dict[str, Any]) -> str:
    found = row.get('machine', {})
    return f'{found.get("host", "?")}: {found.get("device_kind", "?")}'


@functools.cache
def machine() -> dict[str, Any]:
    """Where this process trains: the host, its CPU and cores, the accelerator kind and count."""
    devices = jax.devices()
    return {
        'host': socket.gethostname(),
        'cpu': metrics.cpu_model(),
        'cores': len(os.sched_getaffinity(0)),
        'platform': devices[0].platform,
        'device_kind': devices[0].device_kind,
        'devices': len(devices),
    }


@functools.cache
def commit() -> str:
    """The code's commit (with '+changes' where the checkout has uncommitted changes to tracked files), or
    vrl's installed version outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ['git', '-C', str(root), 'rev-parse', '--short=12', 'HEAD'], capture_output=True, text=True, timeout=10
        )
        if head.returncode == 0:
            dirty = subprocess.run(
                ['git', '-C', str(root), 'status', '--porcelain', '--untracked-files=no'],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return head.stdout.strip() + ('+changes' if dirty else '')
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib import metadata

    try:
        return f'vrl {metadata.version("vrl")}'
    except metadata.PackageNotFoundError:
        return 'unknown'


def _peak_memory() -> tuple[int, str]:
    """The accelerator's peak bytes in use (device 0's, since the process started), or on CPU the process's
    peak resident memory: both of the whole process so far, so shared by every run it trained."""
    stats = jax.devices()[0].memory_stats() or {}
    if 'peak_bytes_in_use' in stats:
        return int(stats['peak_bytes_in_use']), 'device 0, the process so far'
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'host RSS, the process so far'


def _step_seconds(result: dict[str, Any]) -> float:
    """The median step time of a result (from its tokens/s), NaN where none was logged."""
    rate = result.get('tokens_per_sec', float('nan'))
    return float(result['tokens_per_step'] / rate) if rate and np.isfinite(rate) else float('nan')
