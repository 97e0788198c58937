"""Training metrics: MFU, and a writer for metrics.jsonl, TensorBoard and the terminal.

Only process 0 writes. On a terminal a progress bar shows step, loss, tokens/s and ETA;
otherwise (logs, CI) plain lines.

A local workdir's metrics.jsonl is appended to and flushed at every record. A workdir on an object
store has metrics.jsonl and TensorBoard's event files written in local scratch, and each `flush`
(the loop flushes at every checkpoint and evaluation, and at most `FLUSH_SECONDS` after a record)
sends what they grew since the last one, in a background thread, so that the step does not wait
on the store, and the bytes sent over a run are what it logged. A hard kill loses at most the
records since the last flush, all of them after the last checkpoint, which the resumed run logs
again; a resumed run's TensorBoard points from its start step on replace the earlier ones.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from vrl.core import storage
from vrl.core.errors import VrlError
from vrl.model import layer_stats
from vrl.train import tracking
from vrl.train import workdir as workdir_lib

FLUSH_SECONDS = 60.0  # an object-store workdir's metrics reach the store at most this long after a record

# Dense bf16 peak FLOP/s per chip (vendor figures); matched on jax's device_kind, first hit wins.
PEAK_FLOPS = (
    ('v6', 918e12),  # TPU v6e (Trillium)
    ('v5p', 459e12),
    ('v5 lite', 197e12), ('v5e', 197e12),
    ('v5', 459e12),  # 'TPU v5' is v5p
    ('v4', 275e12),
    ('h200', 989e12),
    ('h100', 989e12),
    ('a100', 312e12),
)


@functools.cache
def measured_cpu_peak_flops(compute_dtype: str = 'float32', n: int = 1024, repeats: int = 8) -> float:
    """Matmul FLOP/s of this host in `compute_dtype` (accumulating in float32), measured once with a
    jitted n x n matmul."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(compute_dtype)
    matmul = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    matmul(a).block_until_ready()
    best = float('inf')
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def peak_flops_per_device(configured: float = 0.0, compute_dtype: str = 'float32') -> float:
    """`configured` if set, else the device's dense bf16 peak (accelerators) or this host's measured
    matmul rate in `compute_dtype` (CPU)."""
    if configured:
        return configured
    kind = jax.devices()[0].device_kind.lower()
    for key, flops in PEAK_FLOPS:
        if key in kind:
            return flops
    if jax.default_backend() == 'cpu':
        return measured_cpu_peak_flops(compute_dtype)
    logging.warning('no peak FLOP/s known for device kind %r: set train.peak_flops for MFU', kind)
    return float('nan')


class _StoredLog:
    """A workdir on an object store: metrics.jsonl and the TensorBoard events are written in local
    scratch, and `flush` sends each file's growth since the last flush (storage.append: the bytes
    uploaded over a run are what it logged), in one background upload at a time, and only while
    `guard` confirms that this run still holds the workdir (vrl/train/workdir.py)."""

    def __init__(self, workdir: epath.Path, guard: workdir_lib.Lock | workdir_lib.Lease):
        self.workdir, self.local, self._guard = workdir, storage.scratch(workdir), guard
        (self.local / 'metrics.jsonl').unlink(missing_ok=True)  # an earlier run's are on the store already
        (self.local / 'tensorboard').rmtree(missing_ok=True)
        self._sent = {'metrics.jsonl': 0}  # bytes of each local file on the store, by path under the workdir
        self._extends = {'metrics.jsonl'} if (workdir / 'metrics.jsonl').exists() else set()  # a resumed run's
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
        try:
            self._guard.confirm()
        except VrlError:  # the lease is lost: the loop stops every host at its next check
            return
        for relative, size in storage.files(self.local).items():
            sent = self._sent.get(relative, 0)
            if size > sent:
                with open(self.local / relative, 'rb') as f:
                    f.seek(sent)
                    grown = f.read(size - sent)
                storage.append(self.workdir / relative, grown, new=not sent and relative not in self._extends)
                self._sent[relative] = sent + len(grown)

    def close(self) -> None:
        self.flush(wait=True)
        self._uploads.shutdown()


class MetricsWriter:
    """metrics.jsonl + TensorBoard event files in the workdir, and the terminal."""

    def __init__(self, workdir: str | epath.Path, total_steps: int, start_step: int, enabled: bool,
                 label: str, tracker: tracking.WandbRun | None, guard: workdir_lib.Lock | workdir_lib.Lease):
        """`label` starts every terminal line (a run trained in a group: its folder's name); `tracker`
        also gets every record; `guard` (the workdir's Lock or Lease) is confirmed before each upload
        to an object store."""
        self.enabled, self.label, self._tracker = enabled, label, tracker
        self.total_steps = total_steps
        self._bar = None
        self._stored: _StoredLog | None = None
        if not enabled:
            return
        workdir = storage.path(workdir)
        if storage.is_remote(workdir):
            self._stored = _StoredLog(workdir, guard)
            workdir = self._stored.local
        self._jsonl = open(workdir / 'metrics.jsonl', 'a')
        from tensorboardX import SummaryWriter  # a resumed run's points after its checkpoint replace the earlier
        self._tensorboard = SummaryWriter(str(workdir / 'tensorboard'), purge_step=start_step + 1 if start_step else None)
        if sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit='step', dynamic_ncols=True,
                             desc=label.strip() or None)

    def write(self, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {'step': step, **{k: _plain(v) for k, v in record.items()}}
        self._line(record)
        if self._tracker is not None:
            self._tracker.log(step, record)
        for key, value in record.items():  # a skipped step's NaN stays in metrics.jsonl, out of TensorBoard
            if key != 'step' and isinstance(value, (int, float)) and math.isfinite(value):
                self._tensorboard.add_scalar(key, value, step)
        self._echo(step, record)

    def write_diagnostics(self, step: int, diagnostics: dict[str, list[float]]) -> None:
        """One record {"step": S, "diagnostics": {statistic: [one value per layer]}} in metrics.jsonl,
        and in TensorBoard one chart per statistic, a line per layer (but those without: null)."""
        if not self.enabled:
            return
        self._line({'step': step, 'diagnostics': diagnostics})
        if self._tracker is not None:
            self._tracker.log(step, {'diagnostics': diagnostics})
        for name, values in diagnostics.items():
            self._tensorboard.add_scalars(f'diagnostics/{name}', layer_stats.by_layer(name, values), step)

    def mark_start(self, step: int, how: str, **details: Any) -> None:
        """A record that a run (re)started at `step`: later records of a step supersede earlier ones."""
        if self.enabled:
            self._line({'step': step, 'event': how, 'time': time.strftime('%Y-%m-%d %H:%M:%S'),
                        **{k: v for k, v in details.items() if v}})

    def _line(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + '\n')
        self._jsonl.flush()
        if self._stored is not None and time.monotonic() - self._stored.last_flush > FLUSH_SECONDS:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Puts what was written so far on the store (an object-store workdir): in the background, or
        with `wait` before returning."""
        if self.enabled and self._stored is not None:
            self._tensorboard.flush()
            self._stored.flush(wait)

    def _echo(self, step: int, record: dict[str, Any]) -> None:
        if 'eval_loss' in record:
            domains = ''.join(f'  {key[len("eval_loss/"):]} {value:.4f}' for key, value in record.items()
                              if key.startswith('eval_loss/'))
            self.print(f'step {step}: eval_loss {record["eval_loss"]:.4f}  '
                       f'eval_perplexity {record["eval_perplexity"]:.2f}  eval_bpb {record["eval_bpb"]:.4f}'
                       + (f'  (per dataset:{domains})' if domains else ''))
            return
        epochs = {key[len('epoch/'):]: value for key, value in record.items() if key.startswith('epoch/')}
        short = (f'loss {record["loss"]:.4f}  lr {record["lr"]:.2e}  tok/s {record["tokens_per_sec"]:,.0f}  '
                 f'mfu {record["mfu"]:.1%}' + ('  epoch ' + ' '.join(
                     f'{value:.2f}' if len(epochs) == 1 else f'{name} {value:.2f}' for name, value in epochs.items())
                     if epochs else ''))
        if self._bar is not None:
            self._bar.set_postfix_str(short, refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            eta = (self.total_steps - step) * record['step_time']
            self.print(f'step {step}/{self.total_steps}  {short}  eta {eta / 60:.1f} min')

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(self.label + line)
        else:
            print(self.label + line, flush=True)

    def close(self) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.close()
            self._tensorboard.close()
            if self._tracker is not None:
                self._tracker.finish()
            self._jsonl.close()
            if self._stored is not None:
                self._stored.close()


def _plain(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return value.item()
    return value
