"""A run's metrics on a bucket (vrl/train/trackers/) against the GCS emulator on 127.0.0.1: each
logged byte goes up once, however many flushes, and a resumed run continues one series."""

from __future__ import annotations

import json
import math

import numpy as np

from tests.gcs_emulator import bucket_fs
from tests.helpers import tensorboard_scalars
from vrl.core import storage
from vrl.train import workdir as workdir_lib
from vrl.train.trackers.composite import Trackers


def _log(workdir, lease, steps: range, start_step: int, rng: np.random.Generator) -> None:
    """A writer logging `steps`, flushed after each as a slow run's would be by FLUSH_SECONDS."""
    writer = Trackers.open(workdir, steps.stop - 1, start_step, True, '', lease)
    writer.mark_start(start_step, 'resumed' if start_step else 'started')
    for step in steps:
        writer.write(step, {'loss': float(rng.uniform(2, 5)), 'lr': 1e-3, 'grad_norm': 1.0, 'tokens_per_sec': 1e4,
                            'step_time': 0.1, 'mfu': 0.3})
        writer.write_diagnostics(step, {'attention_entropy': list(rng.uniform(0, 3, 4))})
        writer.flush(wait=True)
    writer.close()


def test_each_logged_byte_goes_up_once_and_a_resume_continues_the_series(gcs, monkeypatch, tmp_path):
    workdir = storage.path('gs://vrl/logged/run')
    lease = workdir_lib.Lease(workdir, stale_after=8.0, say=lambda line: None)
    lease.acquire()
    sent: list[int] = []
    append = storage.append
    monkeypatch.setattr(storage, 'append', lambda p, data, new: (sent.append(len(data)), append(p, data, new))[1])
    rng = np.random.default_rng(0)
    _log(workdir, lease, range(1, 41), 0, rng)
    first = bucket_fs().cat('vrl/logged/run/metrics.jsonl')
    stored = storage.files(workdir)
    assert sum(sent) == sum(size for name, size in stored.items() if name != '.lock')  # O(n): no byte twice
    assert len(sent) >= 2 * 40  # metrics.jsonl and the events grew at every flush

    _log(workdir, lease, range(21, 31), 20, rng)  # resumed from a checkpoint of step 20
    text = bucket_fs().cat('vrl/logged/run/metrics.jsonl')
    assert text.startswith(first)
    records = [json.loads(line) for line in text.decode().splitlines()]
    assert [r['step'] for r in records if 'loss' in r] == list(range(1, 41)) + list(range(21, 31))
    assert records[len(first.decode().splitlines())] | {'time': ''} == {'step': 20, 'event': 'resumed', 'time': ''}

    storage.copy_tree(workdir / 'tensorboard', storage.path(str(tmp_path / 'tb')))
    scalars = tensorboard_scalars(tmp_path / 'tb')
    losses = scalars[('.', 'loss')]
    assert [step for step, _ in losses] == list(range(1, 31))  # no doubled points
    written = {r['step']: r['loss'] for r in records if 'loss' in r}  # a step's last record
    assert all(math.isclose(value, written[step], rel_tol=1e-6) for step, value in losses)
    lease.release()
