"""A run's metrics on a bucket (vrl/train/trackers/) against the GCS emulator on 127.0.0.1: each
logged byte goes up once, however many flushes, and a resumed run continues one series."""

from __future__ import annotations

import math

import numpy as np

from tests.gcs_emulator import bucket_fs, clients_through
from tests.helpers import tensorboard_scalars
from vrl.core import storage
from vrl.train.rundir import lease as lease_lib
from vrl.train.trackers import stored
from vrl.train.trackers.composite import Trackers

WORDS = ['to', 'be', 'or', 'not', 'that', 'is', 'the', 'question']


def _log(workdir, lease, steps: range, start_step: int, rng: np.random.Generator) -> None:
    """A writer logging `steps`, flushed after each as a slow run's would be by FLUSH_SECONDS."""
    writer = Trackers.open(workdir, steps.stop - 1, start_step, True, '', lease)
    writer.mark_start(start_step, 'resumed' if start_step else 'started')
    for step in steps:
        writer.write(
            step,
            {
                'loss': float(rng.uniform(2, 5)),
                'lr': 1e-3,
                'grad_norm': 1.0,
                'tokens_per_sec': 1e4,
                'step_time': 0.1,
                'mfu': 0.3,
                'sample': ' '.join(rng.choice(WORDS, 800)),
            },
        )  # ~4 KB
        writer.write_diagnostics(step, {'attention_entropy': list(rng.uniform(0, 3, 4))})
        writer.flush(wait=True)
    writer.close()


REQUEST_OVERHEAD = 1024  # bytes a request may send besides what it uploads (measured: ~420): line, headers, metadata


def test_each_logged_byte_goes_up_once_and_a_resume_continues_the_series(gcs, tmp_path):
    """Counted at the store (a proxy in front of it): a run that logs 40 steps of large records, each
    flushed, sends what it logged plus a bounded overhead per request, not its whole files again at
    every flush; a resumed run continues the series."""
    from tests.slow_store import SlowStore

    workdir = storage.path('gs://vrl/logged/run')
    rng = np.random.default_rng(0)
    with SlowStore(gcs, latency_s=0.0) as store, clients_through(store.url):
        lease = lease_lib.Lease(workdir, stale_after=60.0, say=lambda line: None)
        lease.acquire()
        _log(workdir, lease, range(1, 41), 0, rng)
        lease.release()
    first = bucket_fs().cat('vrl/logged/run/metrics.e1.jsonl')
    logged = sum(size for name, size in storage.files(workdir).items() if name != '.lock')
    assert logged > 100_000 and len(store.request_lines) >= 3 * 40  # each flush: metrics, events, lease
    assert store.bytes_received < logged + REQUEST_OVERHEAD * len(store.request_lines)  # O(n): no byte twice

    lease = lease_lib.Lease(workdir, stale_after=8.0, say=lambda line: None)  # the resumed run's: epoch 2
    lease.acquire()
    _log(workdir, lease, range(21, 31), 20, rng)  # resumed from a checkpoint of step 20
    assert bucket_fs().cat('vrl/logged/run/metrics.e1.jsonl') == first
    records = stored.read_metrics(workdir)
    assert [r['step'] for r in records if 'loss' in r] == list(range(1, 41)) + list(range(21, 31))
    assert records[len(first.decode().splitlines())] | {'time': ''} == {'step': 20, 'event': 'resumed', 'time': ''}

    storage.copy_tree(workdir / 'tensorboard', storage.path(str(tmp_path / 'tb')))
    scalars = tensorboard_scalars(tmp_path / 'tb')
    losses = scalars[('.', 'loss')]
    assert [step for step, _ in losses] == list(range(1, 31))  # no doubled points
    written = {r['step']: r['loss'] for r in records if 'loss' in r}  # a step's last record
    assert all(math.isclose(value, written[step], rel_tol=1e-6) for step, value in losses)
    lease.release()


def test_records_reach_the_store_at_most_flush_seconds_after_they_are_written(gcs):
    """Between checkpoints, a record goes up with the first record written FLUSH_SECONDS after the last
    upload (in the background), not with every record."""
    from vrl.train.trackers import composite

    workdir = storage.path('gs://vrl/flushed/run')
    lease = lease_lib.Lease(workdir, stale_after=60.0, say=lambda line: None)
    lease.acquire()
    writer = Trackers.open(workdir, 10, 0, True, '', lease)
    record = {'lr': 1e-3, 'grad_norm': 1.0, 'tokens_per_sec': 1e4, 'step_time': 0.1, 'mfu': 0.3}
    writer.write(1, {'loss': 3.0, **record})
    writer.write(2, {'loss': 2.9, **record})
    assert stored.read_metrics(workdir) == []  # within FLUSH_SECONDS of the writer's start
    writer._stored.last_flush -= composite.FLUSH_SECONDS  # the time passes
    writer.write(3, {'loss': 2.8, **record})
    writer._stored._pending.result()
    assert [r['step'] for r in stored.read_metrics(workdir)] == [1, 2, 3]
    writer.close()
    lease.release()
