"""The peak FLOP/s that MFU is measured against (where a run's records go: vrl/train/trackers/)."""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp

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
