"""The workdir's lease on a bucket (vrl/train/rundir/lease.py) against the GCS emulator on
127.0.0.1: one writer at a time, proven by object generations, whatever the clocks say."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from tests.gcs_emulator import bucket_fs
from vrl.core import storage
from vrl.train.rundir import lease as lease_lib
from vrl.train.rundir import workdir as workdir_lib

STALE = 1.0  # seconds: the tests' lease goes stale fast (a run's is at least MIN_LEASE_STALE_SECONDS)


def _lease(name: str, **kwargs) -> lease_lib.Lease:
    return lease_lib.Lease(storage.path(f'gs://vrl/leases/{name}'), stale_after=STALE, say=lambda line: None, **kwargs)


def _dead_holder(name: str, written: str = '2026-11-25 10:00:00') -> None:
    """A lease left by a run that died: never renewed, never released."""
    record = {'holder': 'host dead-vm, pid 1', 'token': 'dead', 'released': False, 'written': written}
    bucket_fs().pipe_file(f'vrl/leases/{name}/.lock', json.dumps(record).encode())


def _race(name: str, takers: int, **kwargs) -> tuple[list[lease_lib.Lease], list[str]]:
    """`takers` leases acquired at once: (the winners, the losers' errors)."""
    leases = [_lease(name, **kwargs) for _ in range(takers)]
    for i, lease in enumerate(leases):  # as from several hosts: each names itself apart
        lease.holder = f'{lease.holder}, taker {i}'
    start = threading.Barrier(takers)

    def take(lease: lease_lib.Lease) -> str:
        start.wait()
        try:
            lease.acquire()
            return ''
        except workdir_lib.WorkdirError as e:
            return str(e)

    with concurrent.futures.ThreadPoolExecutor(takers) as pool:
        outcomes = list(pool.map(take, leases))
    return [lease for lease, error in zip(leases, outcomes) if not error], [e for e in outcomes if e]


def test_of_runs_racing_for_a_stale_lease_exactly_one_wins(gcs):
    for trial in range(8):  # each waits out the dead holder on its own clock, then all write at once
        _dead_holder(f'waited{trial}')
        winners, errors = _race(f'waited{trial}', 4)
        assert len(winners) == 1 and len(errors) == 3, errors
        assert all('took the lease over first' in e or 'is in use by another run' in e for e in errors), errors
        assert json.loads(bucket_fs().cat(f'vrl/leases/waited{trial}/.lock'))['token'] == winners[0].token
        winners[0].release()


def test_takers_that_read_the_same_lease_take_it_once(gcs):
    """--take_over_lease from the same read: one conditional write lands, the others are refused."""
    for trial in range(12):
        _dead_holder(f'now{trial}')
        takers = [_lease(f'now{trial}', take_over=True) for _ in range(6)]
        found = takers[0]._read()
        for taker in takers:  # every taker read that lease, as operators racing would have
            taker._read = lambda found=found: found
        winners, errors = [], []
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            for taker, future in zip(takers, [pool.submit(t.acquire) for t in takers]):
                try:
                    future.result()
                    winners.append(taker)
                except workdir_lib.WorkdirError as e:
                    errors.append(str(e))
        assert len(winners) == 1 and all('took the lease over first' in e for e in errors), errors
        assert json.loads(bucket_fs().cat(f'vrl/leases/now{trial}/.lock'))['token'] == winners[0].token
        del winners[0]._read  # its renewals read the store again
        winners[0].release()


def test_of_runs_racing_for_a_free_workdir_exactly_one_wins(gcs):
    winners, errors = _race('free', 5)
    assert len(winners) == 1 and len(errors) == 4
    assert all('is in use by another run' in e or 'took the lease over first' in e for e in errors), errors
    winners[0].release()
    assert json.loads(bucket_fs().cat('vrl/leases/free/.lock'))['released']
    said = []
    again = lease_lib.Lease(
        storage.path('gs://vrl/leases/free'), stale_after=STALE, say=said.append, clock=lambda: 0.0
    )  # a clock that never moves: any wait would never end
    assert again.acquire() == '' and said == []  # a released lease is taken at once, without a wait
    again.release()


def test_a_live_holder_keeps_its_lease_whatever_its_clock_says(gcs):
    """The holder's record carries a wall time hours old (its clock is behind, or the taker's ahead): a
    taker judging by clocks would take over; by generations it sees the renewals and is refused."""
    holder = _lease('skewed')
    holder.holder = 'host slow-clock, pid 2'
    plain = holder._record
    holder._record = lambda released=False: plain(released).replace(  # its clock, 3 hours behind
        json.dumps(time.strftime('%Y-%m-%d %H:%M:%S')).encode(),
        json.dumps(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(time.time() - 3 * 3600))).encode(),
    )
    holder.acquire()
    assert json.loads(bucket_fs().cat('vrl/leases/skewed/.lock'))['written'] < time.strftime(
        '%Y-%m-%d %H:%M:%S', time.localtime(time.time() - 3600)
    )
    taker = _lease('skewed')
    with pytest.raises(workdir_lib.WorkdirError, match=r'in use by another run \(host slow-clock'):
        taker.acquire()
    holder.confirm()  # still its own
    holder.release()


def test_a_dead_holder_is_taken_over_whatever_its_clock_said(gcs):
    """The converse: a holder that died with its clock 3 hours ahead left a record that looks fresh for
    hours; by generations it is stale after the stale time, and taken over."""
    _dead_holder('ahead', written=time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(time.time() + 3 * 3600)))
    taker = _lease('ahead')
    assert taker.acquire().startswith('took over the lease of workdir gs://vrl/leases/ahead from host dead-vm')
    taker.release()


def test_a_holder_that_froze_past_the_stale_time_stops_before_its_next_write(gcs):
    """On the holder's own (injected) clock: a confirm after half the stale time renews first, and
    succeeds while nobody took over; once another run has, the next confirm finds it out and stops
    the holder, which then writes nothing, not even its release."""
    now = [0.0]
    holder = _lease('frozen', clock=lambda: now[0])
    holder.acquire()
    holder._stop.set()  # its renewals stop, as in a VM paused longer than the stale time
    holder._renewer.join()
    holder._renewer = None
    generation = bucket_fs().info('vrl/leases/frozen/.lock')['generation']
    now[0] += 0.6 * STALE
    holder.confirm()  # late, but nobody took over: the renewal it makes first succeeds
    assert bucket_fs().info('vrl/leases/frozen/.lock')['generation'] != generation
    taker = _lease('frozen', take_over=True)
    assert taker.acquire().startswith('took over the lease of workdir gs://vrl/leases/frozen from host ')
    holder.confirm()  # its last renewal is recent on its clock: it asks nothing yet
    now[0] += 0.6 * STALE
    with pytest.raises(lease_lib.LeaseLostError, match='was taken over by host .*another run may be writing'):
        holder.confirm()
    assert json.loads(bucket_fs().cat('vrl/leases/frozen/.lock'))['token'] == taker.token  # untouched by holder
    holder.release()  # writes nothing: it is not the holder
    assert json.loads(bucket_fs().cat('vrl/leases/frozen/.lock'))['token'] == taker.token
    taker.confirm()
    taker.release()


def test_a_takeover_waits_for_the_stale_time_and_says_so(gcs):
    _dead_holder('said')
    said = []
    taker = lease_lib.Lease(storage.path('gs://vrl/leases/said'), stale_after=2.0, say=said.append)
    started = time.monotonic()
    taker.acquire()
    assert time.monotonic() - started >= 2.0
    assert said[0].startswith('workdir gs://vrl/leases/said is leased by host dead-vm, pid 1: taking it over in 2 s')
    taker.release()


def test_a_store_without_generations_is_refused_in_one_line(small_corpus):
    """A run (or a grid) on an s3:// or az:// workdir is refused before anything is read or written."""
    from tests.runs import tiny_config
    from vrl.train import loop

    with pytest.raises(storage.StorageError, match='a lease needs GCS object generations'):
        storage.read_versioned(storage.path('s3://bucket/run/.lock'))
    for url in ('s3://bucket/run', 'az://container/run'):
        with pytest.raises(
            workdir_lib.WorkdirError,
            match=rf'^{url}: a workdir on an object store is kept by a lease '
            'on GCS object generations, which this store does not have',
        ):
            loop.run(tiny_config(small_corpus, steps=1), url)


def test_the_lease_is_renewed_every_quarter_of_its_stale_time_or_every_store_timeout(monkeypatch):
    """The renewer's wait: stale/4, or VRL_STORE_TIMEOUT_S when shorter (a dead store is noticed by
    the renewals); 2 s at the smallest stale time a config takes (8 s), 60 s by default."""
    from vrl.train.config import MIN_LEASE_STALE_SECONDS

    class Waits:
        def __init__(self):
            self.asked = []

        def wait(self, seconds):
            self.asked.append(seconds)
            return True  # stopped: one round is enough to see the interval

    monkeypatch.delenv('VRL_STORE_TIMEOUT_S', raising=False)
    assert storage.request_timeout_s() == storage.REQUEST_TIMEOUT_S == 60
    for stale, timeout, want in ((MIN_LEASE_STALE_SECONDS, None, 2), (300, None, 60), (300, '5', 5)):
        if timeout:
            monkeypatch.setenv('VRL_STORE_TIMEOUT_S', timeout)
        lease = lease_lib.Lease(storage.path('gs://vrl/leases/interval'), stale_after=stale)
        lease._stop = Waits()
        lease._renew_every()
        assert lease._stop.asked == [want], (stale, timeout)


def test_the_loser_of_a_race_for_a_stale_lease_is_told_who_holds_it(gcs):
    """Two runs wait out a dead holder; the one whose write comes second is told the winner's host
    and pid (not the dead holder's), whichever way it finds out."""
    for trial in range(4):
        _dead_holder(f'told{trial}')
        winners, errors = _race(f'told{trial}', 2)
        assert len(winners) == 1 and len(errors) == 1, errors
        assert winners[0].holder in errors[0], (winners[0].holder, errors[0])
        assert 'host dead-vm, pid 1' not in errors[0] or 'took the lease over from host dead-vm' in errors[0], errors
        winners[0].release()


def test_a_holder_suspended_past_its_lease_finds_it_lost_before_writing(gcs):
    """A VM suspended longer than the lease's staleness: its clock (CLOCK_BOOTTIME in a run) counts
    the suspension, so its first write after waking asks the store first and finds the lease taken
    over. On a clock that stopped while suspended (as CLOCK_MONOTONIC does) it would have written."""
    now = [100.0]
    holder = _lease('suspended', clock=lambda: now[0])
    holder.acquire()
    holder._stop.set()  # its renewer is suspended with it
    taker = _lease('suspended', take_over=True)
    taker.acquire()  # another run, on a live machine, took the workdir over meanwhile
    holder.confirm()  # to the holder no time has passed: nothing is asked, and it could write
    now[0] += 3 * STALE  # it wakes: its clock counted the suspension
    with pytest.raises(lease_lib.LeaseLostError, match=f'was taken over by {taker.holder}'):
        holder.confirm()
    assert json.loads(bucket_fs().cat('vrl/leases/suspended/.lock'))['token'] == taker.token
    taker.release()
    assert lease_lib.elapsed_seconds() >= time.monotonic() - 1  # the boot-time clock runs at least as far


def test_each_taking_is_a_new_epoch_and_a_lost_holder_commits_nothing(gcs):
    """The lease record is the fence: a takeover starts the next epoch and carries the committed steps
    and metrics over; the lost holder's commits raise and leave the record as its successor wrote it."""
    from vrl.train.trackers import stored

    fs = bucket_fs()
    holder = _lease('fenced')
    holder.acquire()
    assert holder.epoch == 1
    fs.pipe_file('vrl/leases/fenced/checkpoints/4.e1/commit_success.txt', b'')
    holder.commit(step=4)
    fs.pipe_file('vrl/leases/fenced/metrics.e1.jsonl', b'{"step": 1}\n{"step": 2}\n')
    holder.commit(logged_bytes=len(b'{"step": 1}\n'))
    taker = _lease('fenced', take_over=True)
    taker.acquire()
    assert (taker.epoch, taker.committed, taker.logged) == (2, {4: 1}, {1: 12})
    record = fs.cat('vrl/leases/fenced/.lock')
    with pytest.raises(lease_lib.LeaseLostError, match=f'was taken over by {taker.holder}'):
        holder.commit(step=8)
    with pytest.raises(lease_lib.LeaseLostError):
        holder.commit(logged_bytes=24)
    assert fs.cat('vrl/leases/fenced/.lock') == record
    fence = lease_lib.read_fence(storage.path('gs://vrl/leases/fenced'))
    assert (fence.epoch, fence.committed, fence.logged) == (2, {4: 1}, {1: 12})
    assert stored.read_metrics(storage.path('gs://vrl/leases/fenced')) == [{'step': 1}]  # not the uncommitted line
    taker.release()
    again = _lease('fenced')
    again.acquire()
    assert again.epoch == 3
    again.release()


@pytest.mark.parametrize('damage', ['deleted', 'garbled'])
def test_a_lost_lease_record_is_recovered_from_the_workdir_not_reset(gcs, damage):
    """The .lock deleted (or overwritten with what is not a lease) under a fenced workdir: the next run
    writes in an epoch above every one the workdir's objects are named for, with the step folders that
    carry Orbax's marker as committed and the metrics files as logged, and says so; nothing of epoch 1
    is written over."""
    fs = bucket_fs()
    holder = _lease(f'lost-{damage}')
    holder.acquire()
    for step in (10, 20):
        fs.pipe_file(f'vrl/leases/lost-{damage}/checkpoints/{step}.e1/state/a', b'x')
        fs.pipe_file(f'vrl/leases/lost-{damage}/checkpoints/{step}.e1/commit_success.txt', b'')
        holder.commit(step=step)
    fs.pipe_file(f'vrl/leases/lost-{damage}/checkpoints/30.e1/state/a', b'half')  # a save that never finished
    fs.pipe_file(f'vrl/leases/lost-{damage}/metrics.e1.jsonl', b'{"step": 1}\n' * 41)
    holder.release()
    if damage == 'deleted':
        fs.rm(f'vrl/leases/lost-{damage}/.lock')
    else:
        fs.pipe_file(f'vrl/leases/lost-{damage}/.lock', b'\x00 not json')
    said = []
    workdir = storage.path(f'gs://vrl/leases/lost-{damage}')
    assert lease_lib.read_fence(workdir) == lease_lib.Fence(1, {10: 1, 20: 1}, {1: 41 * 12})  # what readers see
    taker = lease_lib.Lease(workdir, stale_after=STALE, say=said.append)
    taker.acquire()
    try:
        assert (taker.epoch, taker.committed, taker.logged) == (2, {10: 1, 20: 1}, {1: 41 * 12})
        why = 'missing' if damage == 'deleted' else 'not a lease record'
        assert said == [
            f'the lease {workdir}/.lock was {why}, but the workdir holds objects of lease epochs up to 1: this '
            'run writes in epoch 2, with the steps whose folders carry commit_success.txt as committed ([10, 20])'
        ]
        assert lease_lib.read_fence(workdir) == lease_lib.Fence(2, {10: 1, 20: 1}, {1: 41 * 12})
    finally:
        taker.release()


def test_a_run_moved_aside_on_a_bucket_reads_without_its_lease(gcs):
    """--fresh moves a fenced run's step folders to previous_runs/T and leaves the lease behind: its
    committed steps are still readable there, by their folders' markers (export, --branch_from)."""
    from vrl.train.rundir import checkpoint

    fs = bucket_fs()
    moved = 'vrl/leases/moved/previous_runs/20261202-101010'
    fs.pipe_file(f'{moved}/checkpoints/10.e1/commit_success.txt', b'')
    fs.pipe_file(f'{moved}/checkpoints/20.e2/commit_success.txt', b'')
    fs.pipe_file(f'{moved}/checkpoints/30.e2/state/a', b'unfinished')
    readable = checkpoint.readable_steps(storage.path(f'gs://{moved}/checkpoints'))
    assert {s: m.path.name for s, m in readable.items()} == {10: '10.e1', 20: '20.e2'}


def test_a_long_lived_reader_sees_steps_saved_since_its_last_listing(gcs):
    """A notebook that keeps its process (and gcsfs's listing cache) reads the step a writer in another
    process committed after the reader last listed the folder."""
    import gcsfs

    from vrl.train.rundir import checkpoint

    fs = bucket_fs()
    fs.pipe_file('vrl/leases/reader/checkpoints/4/commit_success.txt', b'')
    folder = storage.path('gs://vrl/leases/reader/checkpoints')
    assert list(checkpoint.readable_steps(folder)) == [4]
    elsewhere = gcsfs.GCSFileSystem(skip_instance_cache=True)  # another process's client: this one's cache stays
    elsewhere.pipe_file('vrl/leases/reader/checkpoints/8/commit_success.txt', b'')
    assert list(checkpoint.readable_steps(folder)) == [4, 8]


def test_of_two_take_overs_one_after_the_other_the_second_does_not_take_from_the_first(gcs):
    """--take_over_lease twice on a dead holder's lease, the second reading it just after the first took
    it: the first's record is a taking not yet renewed, so the second waits it out, sees the first renew,
    and is refused; exactly one wins, and it keeps its lease."""
    _dead_holder('twice')
    workdir, said = storage.path('gs://vrl/leases/twice'), []
    first = lease_lib.Lease(workdir, stale_after=4 * STALE, take_over=True, say=lambda line: None)  # renews after 1 s
    first.acquire()
    second = lease_lib.Lease(workdir, stale_after=4 * STALE, take_over=True, say=said.append)
    try:
        with pytest.raises(workdir_lib.WorkdirError, match='it renewed its lease while this one waited'):
            second.acquire()
        assert 'that lease was taken moments ago and not yet renewed' in said[0]
        first.confirm()  # still its own
    finally:
        first.release()
