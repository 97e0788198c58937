"""Training metrics: MFU, and a writer for metrics.jsonl, TensorBoard and the terminal.

Only process 0 writes. On a terminal a progress bar shows step, loss, tokens/s and ETA;
otherwise (logs, CI) plain lines.
"""

from __future__ import annotations

import functools
import json
import math
import logging
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


class MetricsWriter:
    """metrics.jsonl + TensorBoard event files in the workdir, and the terminal."""

    def __init__(self, workdir: str, total_steps: int, start_step: int, enabled: bool, label: str = ''):
        """`label` starts every terminal line (a run trained in a group: its folder's name)."""
        self.enabled, self.label = enabled, label
        self.total_steps = total_steps
        self._bar = None
        if not enabled:
            return
        self._jsonl = open(Path(workdir) / 'metrics.jsonl', 'a')
        from tensorboardX import SummaryWriter
        self._tensorboard = SummaryWriter(str(Path(workdir) / 'tensorboard'))
        if sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit='step', dynamic_ncols=True,
                             desc=label.strip() or None)

    def write(self, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {'step': step, **{k: _plain(v) for k, v in record.items()}}
        self._jsonl.write(json.dumps(record) + '\n')
        self._jsonl.flush()
        for key, value in record.items():  # a skipped step's NaN stays in metrics.jsonl, out of TensorBoard
            if key != 'step' and isinstance(value, (int, float)) and math.isfinite(value):
                self._tensorboard.add_scalar(key, value, step)
        self._echo(step, record)

    def mark_start(self, step: int, how: str, **details: Any) -> None:
        """A record that a run (re)started at `step`: later records of a step supersede earlier ones."""
        if self.enabled:
            self._jsonl.write(json.dumps({'step': step, 'event': how, 'time': time.strftime('%Y-%m-%d %H:%M:%S'),
                                          **{k: v for k, v in details.items() if v}}) + '\n')
            self._jsonl.flush()

    def _echo(self, step: int, record: dict[str, Any]) -> None:
        if 'eval_loss' in record:
            domains = ''.join(f'  {key[len("eval_loss/"):]} {value:.4f}' for key, value in record.items()
                              if key.startswith('eval_loss/'))
            self.print(f'step {step}: eval_loss {record["eval_loss"]:.4f}  '
                       f'eval_perplexity {record["eval_perplexity"]:.2f}  eval_bpb {record["eval_bpb"]:.4f}'
                       + (f'  (per dataset:{domains})' if domains else ''))
            return
        short = (f'loss {record["loss"]:.4f}  lr {record["lr"]:.2e}  tok/s {record["tokens_per_sec"]:,.0f}  '
                 f'mfu {record["mfu"]:.1%}')
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
            self._jsonl.close()
            self._tensorboard.close()


def _plain(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return value.item()
    return value
