"""The peak FLOP/s that MFU is measured against (where a run's records go: vrl/train/trackers/)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per chip (vendor figures); matched on jax's device_kind, first hit wins.
PEAK_FLOPS = (
    ('v6', 918e12),  # TPU v6e (Trillium)
    ('v5p', 459e12),
    ('v5 lite', 197e12),
    ('v5e', 197e12),
    ('v5', 459e12),  # 'TPU v5' is v5p
    ('v4', 275e12),
    ('h200', 989e12),
    ('h100', 989e12),
    ('a100', 312e12),
)


PROBE_SECONDS = 0.5  # how long the CPU matmul probe repeats its matmul, at least 8 times


@dataclasses.dataclass(frozen=True)
class Peak:
    """The FLOP/s a job's devices can do at most, which MFU is measured against, and where the
    figure comes from (said on the terminal and in bench tables)."""

    flops: float
    source: str

    def __str__(self) -> str:
        return f'{_si(self.flops)}FLOP/s ({self.source})'


def peak_flops(
    configured: float = 0.0, compute_dtype: str = 'float32', devices: Sequence[jax.Device] | None = None
) -> Peak:
    """The peak of `devices` (default: every device of the job): `configured` (train.peak_flops, per
    device) if set, else each accelerator's dense bf16 figure from PEAK_FLOPS, else on CPU each
    host's matmul rate (`host_matmul_peak`: the CPU devices of one host share its cores)."""
    devices = list(jax.devices() if devices is None else devices)
    kind = devices[0].device_kind
    if configured:
        return Peak(configured * len(devices), f'train.peak_flops x {len(devices)} device(s)')
    per_chip = next((flops for key, flops in PEAK_FLOPS if key in kind.lower()), None)
    if per_chip is not None:
        return Peak(per_chip * len(devices), f'{len(devices)} x {kind} at {_si(per_chip)}FLOP/s, bf16 dense')
    if devices[0].platform == 'cpu':
        hosts = len({d.process_index for d in devices})
        host = host_matmul_peak(compute_dtype)
        each = f"{hosts} hosts x {_si(host)}FLOP/s: each host's" if hosts > 1 else "this host's"
        return Peak(host * hosts, f'{each} best measured {compute_dtype} matmul rate, kept in {cpu_peak_file()}')
    logging.warning('no peak FLOP/s known for device kind %r: set train.peak_flops for MFU', kind)
    return Peak(float('nan'), f'unknown for {kind}: set train.peak_flops')


def cpu_peak_file() -> Path:
    """Where the best matmul rates measured on this machine are kept."""
    return Path.home() / '.cache' / 'vrl' / 'cpu_peak.json'


@functools.cache
def host_matmul_peak(compute_dtype: str = 'float32', n: int = 1024) -> float:
    """This host's matmul FLOP/s in `compute_dtype` (accumulating in float32): the best of a jitted
    n x n matmul repeated for PROBE_SECONDS, or the best this CPU (model and core count) has shown
    before, kept in `cpu_peak_file()`. A probe taken while other work shares the cores reads low;
    keeping the best keeps MFU from reading high on a busy host."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(compute_dtype)
    matmul = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    matmul(a).block_until_ready()
    best, started, repeats = float('inf'), time.perf_counter(), 0
    while repeats < 8 or time.perf_counter() - started < PROBE_SECONDS:
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best, repeats = min(best, time.perf_counter() - start), repeats + 1
    measured = 2 * n**3 / best
    key = f'{_cpu_model()} | {len(os.sched_getaffinity(0))} cores | {compute_dtype}'
    kept = _read_kept()
    if measured > kept.get(key, 0.0):
        kept[key] = measured
        try:
            path = cpu_peak_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f'{path.name}.{os.getpid()}')
            temporary.write_text(json.dumps(kept, indent=1, sort_keys=True))
            temporary.replace(path)
        except OSError:  # a read-only home: this probe's figure alone
            pass
    return kept[key]


def _read_kept() -> dict[str, float]:
    try:
        kept = json.loads(cpu_peak_file().read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in kept.items() if isinstance(v, (int, float))} if isinstance(kept, dict) else {}


def _cpu_model() -> str:
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _si(flops: float) -> str:
    """1.2e12 -> '1.2 T' (for 'FLOP/s')."""
    for scale, prefix in ((1e15, 'P'), (1e12, 'T'), (1e9, 'G'), (1e6, 'M')):
        if flops >= scale:
            return f'{flops / scale:,.3g} {prefix}'
    return f'{flops:,.3g} '
