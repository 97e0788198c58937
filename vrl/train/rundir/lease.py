"""A workdir on GCS is kept by a lease (`Lease`): the object `WORKDIR/.lock`, written only on the
generation its writer read, renewed by its holder, and taken over once it has not changed for
train.lease_stale_seconds. Its record is also the run's fence (`Fence`): the epoch whose names the
holder writes in (vrl/train/rundir/workdir.py's `step_name`, `metrics_file`) and what it committed.
vrl/train/rundir/guard.py picks it or a local lock for a workdir.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, Callable

from etils import epath

from vrl.core import peers, storage
from vrl.train.rundir.workdir import COMMITTED, WorkdirError, step_name, step_of, steps_in

NOT_A_LEASE = 'not_a_lease'  # marks the record `Lease._read` stands in for a .lock that is not a lease


def holder_line() -> str:
    """Who holds a guard: this host and process, and since when."""
    return f'host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime("%Y-%m-%d %H:%M:%S")}'


class LeaseLostError(WorkdirError):
    """This run's lease on its workdir was taken over, or could not be renewed in time: another run
    may be writing there, so this one writes nothing more."""


class Lease:
    """A workdir on GCS's: the object `WORKDIR/.lock` (JSON: holder, token), which one run at a time
    holds, proven by the object's generation (GCS changes it at every write):

    - taking it: create it only if absent, or replace a released one or one whose holder is gone;
      every write is conditional on the generation read before it, so of two runs racing for it
      exactly one wins;
    - a holder renews it (a conditional rewrite) from its own thread every stale_after / 4 s;
    - a holder is gone when the generation stays the same for stale_after seconds of the waiting
      run's own clock, `elapsed_seconds` (no clocks are compared); `take_over=True` takes it at once;
    - the holder writes only while its lease is surely its own: `confirm()`, before each checkpoint
      and upload, raises LeaseLostError once a renewal found the lease taken, or when no renewal
      has succeeded for stale_after / 2 s and one more attempt fails. A taker waits stale_after
      after the holder's last renewal, so the holder stops writing first.
    - releasing it writes a released record (conditional too); the next run takes that at once.

    The record is also the run's fence. Each taking starts an `epoch` (the previous record's plus
    one), in whose names the holder writes (checkpoint steps STEP.eEPOCH, metrics.eEPOCH.jsonl), and
    `commit` adds what became readable (`committed`: step -> epoch; `logged`: epoch -> bytes of its
    metrics) by the same conditional rewrite: a holder that lost the lease can still write bytes in its
    own names, but never commit them, so no reader (vrl/train/rundir/checkpoint.py, `read_metrics`) sees them.
    """

    def __init__(
        self,
        workdir: epath.Path,
        holder_kind: str = 'run',
        stale_after: float = 300.0,
        take_over: bool = False,
        say=print,
        clock: Callable[[], float] | None = None,
    ):
        self.path, self.holder_kind, self.stale_after = workdir / '.lock', holder_kind, stale_after
        self.take_over, self.say = take_over, say
        self._clock = clock or elapsed_seconds  # every staleness is measured on it
        self.store_gone: Callable[[str], None] = peers.abort  # ends the process: the store does not answer
        self.token = uuid.uuid4().hex
        self.holder = holder_line()
        self.epoch = 0  # of this run's taking (process 0's until `Member` shares it)
        self.committed: dict[int, int] = {}  # readable checkpoint step -> the epoch that wrote it
        self.logged: dict[int, int] = {}  # epoch -> bytes of its metrics file that are readable
        self.lost = ''  # why this run no longer holds the lease, once it does not
        self.created = False  # whether `guard.hold` made the workdir
        self._generation = 0  # of the lease object as this run last wrote it
        self._renewed_at = 0.0  # when (self._clock) the last successful renewal was sent
        self._writes = 0  # of this run's record since it took the lease
        self._lock = threading.Lock()  # one conditional write at a time
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self, released: bool = False) -> bytes:
        return json.dumps(
            {
                'holder': self.holder,
                'token': self.token,
                'released': released,
                'written': time.strftime('%Y-%m-%d %H:%M:%S'),
                'epoch': self.epoch,
                'committed': self.committed,
                'logged': self.logged,
                'renewals': self._writes,  # 0: the taking itself, not yet renewed
            }
        ).encode()

    def _read(self) -> tuple[dict[str, Any], int] | None:
        found = storage.read_versioned(self.path)
        if found is None:
            return None
        try:
            return json.loads(found[0]), found[1]
        except ValueError:  # not a lease (a local workdir's flock file, copied up, or a damaged record): free
            return {'holder': 'a .lock that is not a lease', 'token': '', 'released': True, NOT_A_LEASE: True}, found[1]

    def _succeed(self, held: dict[str, Any] | None) -> None:
        """This run's epoch and readable objects, taking over from record `held`; where there is none, or
        it is not a lease, from what the workdir's objects say (`recover_fence`), so that no step or
        metrics file of an earlier epoch is written over."""
        fence = read_fence_record(held) if held and not held.get(NOT_A_LEASE) else recover_fence(self.path.parent)
        self.epoch, self.committed, self.logged = fence.epoch + 1, fence.committed, fence.logged

    def _write(self, generation: int) -> bool:
        """Writes this run's record over `generation`; whether it did."""
        sent = self._clock()
        written = storage.write_if(self.path, self._record(), generation)
        if written is None:
            return False
        self._generation, self._renewed_at, self._writes = written, sent, self._writes + 1
        return True

    def acquire(self) -> str:
        """Takes the lease, waiting out a holder that stopped renewing; returns a line for the log when
        it took one over. WorkdirError if a live holder has it."""
        while True:
            found = self._read()
            self._succeed(found and found[0])
            if found is None:
                if self._write(0):
                    self._say_recovered('missing')
                    break
                continue  # created by another run meanwhile: read it
            held, generation = found
            if held.get('released'):
                if self._write(generation):
                    if held.get(NOT_A_LEASE):
                        self._say_recovered('not a lease record')
                    break
                continue
            if not self.take_over or not held.get('renewals', 1):  # a taking not yet renewed may be live
                self._wait_out(held, generation)
            if not self._write(generation):
                raise WorkdirError(
                    f'workdir {self.path.parent}: another {self.holder_kind} ({self._holder_now()}) '
                    'took the lease over first; stop it or choose another --workdir.'
                )
            line = f'took over the lease of workdir {self.path.parent} from {held.get("holder")}: ' + (
                '--take_over_lease'
                if self.take_over
                else f'not renewed for {self.stale_after:.0f} s (train.lease_stale_seconds)'
            )
            logging.warning('%s', line)
            self._start_renewing()
            return line
        self._start_renewing()
        return ''

    def _say_recovered(self, why: str) -> None:
        """Tells the user that the fence of a workdir with earlier epochs came from its objects."""
        if self.epoch > 1:
            self.say(
                f'the lease {self.path} was {why}, but the workdir holds objects of lease epochs up to '
                f'{self.epoch - 1}: this run writes in epoch {self.epoch}, with the steps whose folders carry '
                f'{COMMITTED} as committed ({sorted(self.committed) or "none"})'
            )

    def _wait_out(self, held: dict[str, Any], generation: int) -> None:
        """Returns once `generation` has stayed the live one for stale_after seconds; WorkdirError as
        soon as it changes (its holder renewed it, or another run took it). With take_over, only a
        lease just taken and not yet renewed is waited out: of two runs taking over at once, the one
        that came second must not take the lease from the first."""
        deadline = self._clock() + self.stale_after
        self.say(
            f'workdir {self.path.parent} is leased by {held.get("holder")}: taking it over in '
            f'{self.stale_after:.0f} s unless its holder renews it (train.lease_stale_seconds; '
            + (
                '--take_over_lease waits too: that lease was taken moments ago and not yet renewed)'
                if self.take_over
                else '--take_over_lease if that run is surely gone)'
            )
        )
        said = self._clock()
        while (left := deadline - self._clock()) > 0:
            time.sleep(min(left, max(1.0, self.stale_after / 16)))
            found = self._read()
            if found is None or found[1] != generation:
                renewed = found is not None and found[0].get('token') == held.get('token')
                how = (
                    'it renewed its lease while this one waited'
                    if renewed
                    else f'it took the lease over from {held.get("holder")} while this one waited'
                )
                raise WorkdirError(
                    f'workdir {self.path.parent} is in use by another {self.holder_kind} '
                    f'({self._holder_now(found)}; {how}); stop it or choose another --workdir.'
                )
            if self._clock() - said >= 30 and left > 5:
                self.say(f'  ... {left:.0f} s until the lease of {self.path.parent} is taken over')
                said = self._clock()

    def _holder_now(self, found: tuple[dict[str, Any], int] | None | bool = False) -> str:
        """Who holds the lease as the store says now (`found`: a read already made)."""
        found = self._read() if found is False else found
        return 'nobody: it was deleted' if found is None else found[0].get('holder', '?')

    def _start_renewing(self) -> None:
        self._renewer = threading.Thread(target=self._renew_every, name='vrl-lease', daemon=True)
        self._renewer.start()

    def _renew_every(self) -> None:
        """Renews every stale_after / 4 s, or every request timeout T of the store if shorter (the
        renewals are what notices a store that stopped answering): each renewal is given up after T,
        and renewals that have failed for 2 T end the process (`store_gone`), whatever its main
        thread is waiting on. A shorter outage is retried (`confirm` decides whether a write may go)."""
        timeout = storage.request_timeout_s()
        failing_since = None
        while not self._stop.wait(min(self.stale_after / 4, timeout)) and not self.lost:
            started = self._clock()
            try:
                storage.within(timeout, self.renew)
                failing_since = None
            except Exception as e:  # noqa: BLE001 - a passing outage, until it lasts
                failing_since = started if failing_since is None else failing_since
                cause = ' '.join(f'{type(e).__name__}: {e}'.split()).rstrip(': ')
                if self._clock() - failing_since >= 2 * timeout and not self._stop.is_set():
                    self.store_gone(
                        f'the object store stopped answering: renewing the lease {self.path} failed '
                        f'for {self._clock() - failing_since:.0f} s ({cause}; VRL_STORE_TIMEOUT_S='
                        f'{timeout:g}). This {self.holder_kind} stops here, its last checkpoint intact: '
                        'run the same command once the store answers.'
                    )
                logging.warning('renewing the lease of workdir %s failed (%s); retrying', self.path.parent, cause)

    def renew(self) -> None:
        """One conditional rewrite; a lease found changed is lost (`lost` says why)."""
        with self._lock:
            self._rewrite()

    def commit(self, step: int | None = None, logged_bytes: int | None = None) -> None:
        """Makes checkpoint `step` of this epoch, or the first `logged_bytes` of its metrics file,
        readable, with the renewal's conditional rewrite; LeaseLostError if this run no longer holds
        the lease (what it wrote stays unread). Committed steps whose folders are gone are dropped."""
        with self._lock:
            if step is not None:
                kept = steps_in(self.path.parent / 'checkpoints')
                self.committed = {s: e for s, e in self.committed.items() if step_name(s, e) in kept} | {
                    step: self.epoch
                }
            if logged_bytes is not None:
                self.logged = {**self.logged, self.epoch: logged_bytes}
            if not self._rewrite():
                raise LeaseLostError(
                    f'{self.lost}: this {self.holder_kind} stopped without making more of what it '
                    'wrote readable; its last committed checkpoint is intact.'
                )

    def _rewrite(self) -> bool:
        """Writes the record over the generation this run last wrote; whether it still holds the lease
        (if not, `lost` says why)."""
        if self.lost or self._write(self._generation):
            return not self.lost
        found = self._read()  # changed: by a retried write of ours that had landed, or by a taker
        if found is not None and found[0].get('token') == self.token and not found[0].get('released'):
            self._generation = found[1]
            if self._write(self._generation):
                return True
            found = self._read()
        self.lost = (
            f'the lease of workdir {self.path.parent} was taken over by '
            f'{(found or ({"holder": "nobody (deleted)"}, 0))[0].get("holder")}'
        )
        logging.error('%s; this run writes nothing more there', self.lost)
        return False

    def confirm(self) -> None:
        """Returns if this run surely still holds the lease: a write may follow. LeaseLostError if not."""
        if not self.lost and self._clock() - self._renewed_at > self.stale_after / 2:
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - unrenewable: another run may take the lease over soon
                self.lost = (
                    f'the lease of workdir {self.path.parent} could not be renewed for '
                    f'{self._clock() - self._renewed_at:.0f} s ({e})'
                )
        if self.lost:
            raise LeaseLostError(
                f'{self.lost}: another {self.holder_kind} may be writing there, so this one '
                'stopped without writing more; its last checkpoint is intact.'
            )

    def release(self) -> None:
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join()
        self._renewer = None
        with self._lock:
            if self.lost:
                return
            try:
                storage.write_if(self.path, self._record(released=True), self._generation)
            except Exception as e:  # noqa: BLE001 - unreleased, the lease is taken over once stale
                logging.warning('releasing the lease of workdir %s failed (%s)', self.path.parent, e)


@dataclasses.dataclass(frozen=True)
class Fence:
    """What a workdir's lease record makes readable: the latest `epoch`, its committed checkpoint
    steps (step -> epoch) and each epoch's readable metrics bytes."""

    epoch: int = 0
    committed: dict[int, int] = dataclasses.field(default_factory=dict)
    logged: dict[int, int] = dataclasses.field(default_factory=dict)


def read_fence_record(record: dict[str, Any]) -> Fence:
    """The fence of a lease record (JSON keys are strings); a record from before fencing has none."""
    return Fence(
        int(record.get('epoch', 0)),
        {int(k): int(v) for k, v in record.get('committed', {}).items()},
        {int(k): int(v) for k, v in record.get('logged', {}).items()},
    )


def read_fence(workdir: epath.Path) -> Fence:
    """The fence of the lease at `workdir` (a remote workdir's; none elsewhere); where its lease is gone
    or is not a lease record (a run moved aside by --fresh, whose lease stays behind; a deleted or
    damaged .lock), what the workdir's objects say (`recover_fence`)."""
    if not storage.is_remote(workdir):
        return Fence()
    found = storage.read_versioned(workdir / '.lock') if str(workdir).startswith(('gs://', 'gcs://')) else None
    try:
        return read_fence_record(json.loads(found[0])) if found else recover_fence(workdir)
    except (ValueError, AttributeError):  # a local flock file copied up, or a damaged record
        return recover_fence(workdir)


def recover_fence(workdir: epath.Path) -> Fence:
    """A remote workdir's fence from its objects alone (one listing): the newest epoch any step folder
    (checkpoints/STEP.eEPOCH) or metrics file (metrics.eEPOCH.jsonl) is named for, each step's newest
    folder that carries Orbax's COMMITTED marker, and each epoch's metrics file whole."""
    epochs, committed, logged = [0], {}, {}
    for relative, size in (storage.files(workdir) if storage.is_remote(workdir) else {}).items():
        parts = relative.split('/')
        if len(parts) >= 3 and parts[0] == 'checkpoints' and (named := step_of(parts[1])) and named[1]:
            epochs.append(named[1])
            if parts[2:] == [COMMITTED] and named[1] >= committed.get(named[0], 0):
                committed[named[0]] = named[1]
        elif len(parts) == 1 and (metrics := re.fullmatch(r'metrics\.e(\d+)\.jsonl', relative)):
            epochs.append(int(metrics.group(1)))
            logged[int(metrics.group(1))] = size
    return Fence(max(epochs), dict(sorted(committed.items())), logged)


def elapsed_seconds() -> float:
    """Seconds on a clock that also counts while the machine is suspended (CLOCK_BOOTTIME, on Linux;
    elsewhere the monotonic clock): a VM suspended past a lease's staleness finds it stale on
    waking, rather than writing as its holder."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, 'CLOCK_BOOTTIME') else time.monotonic()
