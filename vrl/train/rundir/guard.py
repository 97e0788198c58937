"""One writer per workdir: its guard, taken by process 0 of a run (all processes of one run share
the workdir). A local workdir: `Lock`, an exclusive `flock` on `WORKDIR/.lock`, which the kernel
drops when the holder dies (kill -9, a lost VM), so a stale lock never blocks. A workdir on an
object store, where nothing can be locked: a `Lease` (vrl/train/rundir/lease.py). Either names the holder
in the refusal; `confirm()` before each write stops a holder that lost it.

- `make(workdir)`: the guard for a workdir;
- `hold(guard)` and `release(guard)`: taken (the workdir created and proven writable first) and
  given back (a workdir it created that holds nothing else removed);
- `in_use(workdir)`: whether a run holds it now (a source read while it still trains).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil

from etils import epath

from vrl.core import storage
from vrl.train.rundir.lease import Lease, LeaseLostError, holder_line
from vrl.train.rundir.workdir import WorkdirError


class Lock:
    """A local workdir's: held from `acquire` until `release` or the process's death."""

    def __init__(self, workdir: epath.Path, holder_kind: str = 'run'):
        self.path = workdir / '.lock'
        self.holder_kind = holder_kind  # what holds it, for the refusal: 'run', 'comparison', 'study'
        self._lost = ''  # see `lost`
        self.created = False  # whether `hold` made the workdir
        self.epoch = 0  # a flock is its own fence: step folders keep Orbax's plain names
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode(errors='replace').strip() or 'a process that is starting'
            os.close(fd)
            raise WorkdirError(
                f'workdir {self.path.parent} is in use by another {self.holder_kind} ({holder}); '
                'stop it or choose another --workdir.'
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, holder_line().encode())
        os.fsync(fd)
        self._fd = fd

    @property
    def lost(self) -> str:
        """Why this run no longer holds its workdir ('' while it does): the kernel holds a flock for its
        holder's life, but only on the file it was taken on; once `.lock` is removed or replaced (by
        hand), a second run can lock the new one. Read at every step (hooks.Leases) and before writes."""
        if self._lost or self._fd is None:
            return self._lost
        try:
            same = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            self._lost = (
                f'the lock file {self.path} was removed or replaced while this {self.holder_kind} held it, so '
                'another one may be writing in the workdir: this one stopped without writing more; its last '
                'checkpoint is intact (never delete the .lock of a live run).'
            )
        return self._lost

    def confirm(self) -> None:
        """LeaseLostError (before the write that would follow) once the lock is `lost`."""
        if self.lost:
            raise LeaseLostError(self.lost)

    def commit(self, step: int | None = None, logged_bytes: int | None = None) -> None:
        """Nothing to record: only a live holder writes, and Orbax's rename commits a step."""

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


Guard = Lock | Lease


def hold(guard: Guard) -> None:
    """Creates the guard's workdir and proves it writable (StorageError in one line naming the path
    and what to do, before anything is compiled or written), then takes the guard; a stale lease taken
    over is said on stdout."""
    workdir = guard.path.parent
    existed = storage.is_remote(workdir) or workdir.exists()  # a bucket has no folders: empty is new
    storage.check_writable(workdir, '--workdir', arrays=True)
    created = not existed or (storage.is_remote(workdir) and not storage.files(workdir))
    if taken_over := guard.acquire():
        print(taken_over, flush=True)
    guard.created = created


def release(guard: Guard) -> None:
    """Releases the guard; a workdir that `hold` created and that holds no file but the guard's is
    removed, with the empty folders made in it (Orbax's `checkpoints/`): a run refused before it wrote
    anything leaves no trace."""
    guard.release()
    workdir = guard.path.parent
    if guard.created and set(storage.files(workdir)) <= {guard.path.name}:
        storage.delete(guard.path)
        if not storage.is_remote(workdir):
            shutil.rmtree(workdir)
        guard.created = False


def in_use(workdir: epath.Path) -> bool:
    """Whether a run holds `workdir` now: its flock taken (locally), or its lease not released (on an
    object store; a holder that died unreleased counts until it is taken over)."""
    lock = workdir / '.lock'
    if storage.is_remote(workdir):
        found = storage.read_versioned(lock)
        try:
            return found is not None and not json.loads(found[0]).get('released', True)
        except ValueError:  # a local workdir's flock file, copied up: no lease
            return False
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # and with it the shared lock, if it was taken
    return False


def make(workdir: epath.Path, holder_kind: str = 'run', stale_after: float = 300.0, take_over: bool = False) -> Guard:
    """The guard that keeps a second writer out of `workdir`: a flock locally, a lease on an object
    store (`take_over`: at once, from a holder known to be gone)."""
    if storage.is_remote(workdir) and not str(workdir).startswith(('gs://', 'gcs://')):
        raise WorkdirError(
            f'{workdir}: a workdir on an object store is kept by a lease on GCS object generations, '
            'which this store does not have; use a gs:// or a local path.'
        )
    if storage.is_remote(workdir):
        return Lease(workdir, holder_kind, stale_after, take_over)
    return Lock(workdir, holder_kind)
