"""The peak FLOP/s that MFU is measured against (where a run's records go: vrl/train/trackers/)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import platform
import resource
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

from vrl.core import backend

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
    host's reference matmul rate (`host_matmul_peak`: the CPU devices of one host share its cores)."""
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
        if hosts == 1:
            return host
        return Peak(
            host.flops * hosts,
            f'{hosts} hosts x {_si(host.flops)}FLOP/s, ' + host.source.replace("this host's", "each host's"),
        )
    logging.warning('no peak FLOP/s known for device kind %r: set train.peak_flops for MFU', kind)
    return Peak(float('nan'), f'unknown for {kind}: set train.peak_flops')


def cpu_peak_file() -> Path:
    """Where each CPU's reference matmul rates are kept, measured once on an idle machine."""
    return Path.home() / '.cache' / 'vrl' / 'cpu_peak.json'


BUSY_LIMIT = 0.1  # the share of its cores other work may take while a reference rate is measured


@functools.cache
def host_matmul_peak(compute_dtype: str = 'float32', n: int = 1024) -> Peak:
    """This host's reference matmul FLOP/s in `compute_dtype` (accumulating in float32), a property of
    the machine: for each (CPU model, cores this process may use, dtype, matmul kernels), the best of
    a jitted n x n matmul repeated for PROBE_SECONDS, measured the first time with the cores idle and
    kept in `cpu_peak_file()`; later runs read it and never replace it (remove the file to measure
    again). A probe during which other work took more than BUSY_LIMIT of the cores reads low and is
    not kept: that run's MFU is against it, said to be provisional."""
    key = f'{cpu_model()} | {len(os.sched_getaffinity(0))} cores | {compute_dtype} | {backend.cpu_matmul_path()}'
    where = f'on {backend.describe_cpu_isa()} with {backend.cpu_matmul_path()} kernels'
    kept = _read_kept()
    if key in kept:
        reference = kept[key]
        return Peak(
            reference['flops'],
            f"this host's {compute_dtype} matmul rate {where}, measured idle on {reference['measured']}, kept in "
            f'{cpu_peak_file()}',
        )
    flops, others = _probe(compute_dtype, n)
    if others > BUSY_LIMIT:
        return Peak(
            flops,
            f"this host's {compute_dtype} matmul rate {where}, measured now, provisional: other work took "
            f'{others:.0%} of the cores meanwhile, so it is not kept as the reference and MFU may read high',
        )
    kept[key] = {'flops': flops, 'measured': time.strftime('%Y-%m-%d'), 'others_busy': round(others, 3)}
    try:
        path = cpu_peak_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f'{path.name}.{os.getpid()}')
        temporary.write_text(json.dumps(kept, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError:  # a read-only home: this probe's figure alone
        pass
    return Peak(flops, f"this host's {compute_dtype} matmul rate {where}, measured idle now, kept in {cpu_peak_file()}")


def _probe(compute_dtype: str, n: int) -> tuple[float, float]:
    """(the best FLOP/s of an n x n matmul over PROBE_SECONDS and at least 8 repeats, the share of this
    process's cores that other work took meanwhile)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(compute_dtype)
    matmul = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    matmul(a).block_until_ready()
    busy_before, own_before, started = _cores_busy_seconds(), _own_cpu_seconds(), time.perf_counter()
    best, repeats = float('inf'), 0
    while repeats < 8 or time.perf_counter() - started < PROBE_SECONDS:
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best, repeats = min(best, time.perf_counter() - start), repeats + 1
    wall = time.perf_counter() - started
    others = (_cores_busy_seconds() - busy_before) - (_own_cpu_seconds() - own_before)
    return 2 * n**3 / best, max(others, 0.0) / (wall * len(os.sched_getaffinity(0)))


def _cores_busy_seconds(stat: Path = Path('/proc/stat')) -> float:
    """CPU seconds spent so far on the cores this process may use, by anyone (user, system, interrupts,
    and time a hypervisor gave to other machines: steal); 0 where /proc/stat is not there."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0.0
    mine, ticks = {f'cpu{i}' for i in os.sched_getaffinity(0)}, os.sysconf('SC_CLK_TCK')
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name in mine:  # user nice system idle iowait irq softirq steal ...
            values = [int(v) for v in fields[:8]]
            busy += sum(values) - values[3] - values[4]
    return busy / ticks


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _read_kept() -> dict[str, dict]:
    """The kept references, {key: {'flops', 'measured', 'others_busy'}}; records of another form are not read."""
    try:
        kept = json.loads(cpu_peak_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(kept, dict):
        return {}
    return {k: v for k, v in kept.items() if isinstance(v, dict) and isinstance(v.get('flops'), (int, float))}


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (the platform's processor elsewhere)."""
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
