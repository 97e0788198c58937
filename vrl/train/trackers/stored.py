"""A workdir on an object store: metrics.jsonl and the TensorBoard events are written in local
scratch, and `flush` sends each file's growth since the last flush (storage.append: the bytes
uploaded over a run are what it logged), in one background upload at a time, so that the step does
not wait on the store, and only while the run still holds the workdir (vrl/train/rundir/workdir.py). A
hard kill loses at most the records since the last flush, all of them after the last checkpoint,
which the resumed run logs again.

The lease fences the records: this run's metrics go to `metrics.eEPOCH.jsonl` (its lease epoch), and
after each upload the lease record commits how many of its bytes are readable (`read_metrics` reads
no further), so the records a run sends after losing its lease are never read. The TensorBoard
events' growth is sent only after such a commit succeeds, and holds no point whose record it did not
commit."""

from __future__ import annotations

import concurrent.futures
import os
import time

from etils import epath

from vrl.core import storage
from vrl.core.errors import VrlError
from vrl.train.rundir import guard as guard_lib
from vrl.train.rundir import lease
from vrl.train.rundir.workdir import metrics_file
from vrl.train.trackers import jsonl


class StoredLog:
    def __init__(self, workdir: epath.Path, guard: guard_lib.Guard):
        self.workdir, self.local, self._guard = workdir, storage.scratch(workdir), guard
        (self.local / 'metrics.jsonl').unlink(missing_ok=True)  # an earlier run's are on the store already
        (self.local / 'tensorboard').rmtree(missing_ok=True)
        self._sent = {'metrics.jsonl': 0}  # bytes of each local file on the store, by path under the workdir
        self._uploads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='vrl-metrics')
        self._pending: concurrent.futures.Future | None = None
        self.last_flush = time.monotonic()

    def flush(self, wait: bool = False) -> None:
        """An upload in the background (none while one still runs: the next flush takes its records),
        or with `wait` here, after the one in flight."""
        self.last_flush = time.monotonic()
        if wait:
            if self._pending is not None:
                self._pending.result()
            self._upload()
        elif self._pending is None or self._pending.done():
            self._pending = self._uploads.submit(self._upload)

    def _upload(self) -> None:
        """The metrics' growth, committed in the lease, then the events' growth. The events' sizes are
        taken before the metrics' (a record is written to the metrics first), so every point sent has
        its record committed: what TensorBoard reads is what the lease made readable."""
        try:
            self._guard.confirm()
        except VrlError:  # the lease is lost: the loop stops every host at its next check
            return
        sizes = storage.files(self.local)
        sizes['metrics.jsonl'] = os.path.getsize(self.local / 'metrics.jsonl')
        if not self._send('metrics.jsonl', sizes['metrics.jsonl'], metrics_file(self._guard.epoch)):
            return
        for relative, size in sizes.items():
            if relative != 'metrics.jsonl':
                self._send(relative, size, relative)

    def _send(self, relative: str, size: int, target: str) -> bool:
        """Appends local file `relative`'s bytes up to `size` not yet sent to `target` in the workdir (the
        metrics' then committed); whether this run may go on sending."""
        sent = self._sent.get(relative, 0)
        if size <= sent:
            return True
        with open(self.local / relative, 'rb') as f:
            f.seek(sent)
            grown = f.read(size - sent)
        storage.append(self.workdir / target, grown, new=not sent)
        self._sent[relative] = sent + len(grown)
        if relative == 'metrics.jsonl':
            try:
                self._guard.commit(logged_bytes=self._sent[relative])
            except VrlError:  # lost meanwhile: the loop stops every host at its next check
                return False
        return True

    def close(self) -> None:
        self.flush(wait=True)
        self._uploads.shutdown()


def read_metrics(workdir: epath.Path) -> list[dict]:
    """The records of a run's metrics, in the order they were logged: a local workdir's metrics.jsonl;
    an object store's, each lease epoch's committed bytes in turn (after metrics.jsonl, a run's from
    before fencing); in a folder without a lease (a run moved aside by --fresh), each file whole."""
    files: list[tuple[str, int | None]] = [('metrics.jsonl', None)]
    if storage.is_remote(workdir) and (workdir / '.lock').exists():
        files += [(metrics_file(epoch), size) for epoch, size in sorted(lease.read_fence(workdir).logged.items())]
    elif storage.is_remote(workdir):
        before, after = metrics_file('*').split('*')
        epochs = sorted(int(p.name[len(before) : -len(after)]) for p in workdir.glob(metrics_file('*')))
        files += [(metrics_file(epoch), None) for epoch in epochs]
    records = []
    for name, size in files:
        if (workdir / name).exists():
            text = (workdir / name).read_bytes()[:size].decode(errors='replace')
            records += jsonl.records(text, str(workdir / name))
    return records
