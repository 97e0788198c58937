"""Ahead-of-time compilation of the real train step, for the local devices or a TPU slice, and
the settings that make it fit.

    python -m vrl.main --config=configs/svformer_468m.py --compile_only --topology=v5e:4x4

With `libtpu` installed (`pip install -r requirements-tpu.txt`), `jax.experimental.topologies` describes a
TPU slice on any machine, so the step is compiled for that slice's devices and mesh without a
TPU, and XLA's memory analysis says whether it fits each chip's HBM.

`resolve` resolves every `auto` of a config before a TrainSteps is built: the model's per-platform
choices (vrl/model/resolve.py), then `train.microbatches=0` and `model.remat=auto` by `auto_fit` (before
training, and in --compile_only): the fewest microbatches, then the cheapest remat policy, whose
compiled step fits FIT_MARGIN of each device's memory (1 and none where no memory limit is known).
With `mesh.context=0`, `fit_context` first tries each context size, fewest devices per sequence
first, and keeps the first at which the step fits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from vrl.core import backend, extras, sharding
from vrl.core.config import ConfigError
from vrl.core.errors import VrlError
from vrl.model import accounting
from vrl.model import resolve as model_resolve
from vrl.train.config import Config, OptimizerConfig, check_fits_mesh
from vrl.train.step import TrainSteps

GiB = 1 << 30
FIT_MARGIN = 0.9  # of a device's memory: the rest is for the runtime, fragmentation and the data
REMAT_BY_COST = ('none', 'save_dots', 'full')  # least recomputation first; most memory saved last


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    chip_config: str  # 'megacore': one device per chip of two TensorCores
    chips_per_host: tuple[int, int, int]
    hbm_bytes: int  # per chip
    accelerator_type: str  # Cloud TPU's name of a slice of N chips, e.g. 'v5litepod-{N}'

    def accelerator_type_of(self, chips: int) -> str:
        return self.accelerator_type.format(N=chips, cores=2 * chips)


TPU_GENERATIONS = {
    'v4': TpuGeneration('megacore', (2, 2, 1), 32 * GiB, 'v4-{cores}'),
    'v5e': TpuGeneration('default', (2, 2, 1), 16 * GiB, 'v5litepod-{N}'),
    'v5p': TpuGeneration('megacore', (2, 2, 1), 95 * GiB, 'v5p-{cores}'),
    'v6e': TpuGeneration('default', (2, 2, 1), 32 * GiB, 'v6e-{N}'),
}


TPU_FILE = 'requirements-tpu.txt'  # libtpu, which describes a TPU slice for an ahead-of-time compile


class CompileError(VrlError, ValueError):
    """A topology that cannot be described, or a step that does not fit."""


def tpu_devices(topology: str, num_slices: int = 1) -> tuple[Sequence[jax.Device], int]:
    """The devices of `num_slices` slices such as 'v5e:4x4' or 'v5p:2x2x2' (each device knows its
    `slice_index`), and the HBM of each chip."""
    generation_name, _, shape = topology.partition(':')
    generation = TPU_GENERATIONS.get(generation_name)
    if generation is None or not shape:
        raise CompileError(
            f'--topology={topology!r} is invalid: allowed GENERATION:SHAPE with GENERATION '
            f'one of {sorted(TPU_GENERATIONS)}, e.g. v5e:4x4 or v5p:2x2x2.'
        )
    extras.require(f'--topology={topology} (describing a TPU slice; no TPU needed)', 'libtpu', requirements=TPU_FILE)
    dims = [int(d) for d in shape.split('x')]
    # describing a slice claims no chip: no need for libtpu's one-process lockfile, so several
    # compiles (processes, test workers) may run side by side
    os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
    backend.name_absent_tpu_host(generation.accelerator_type_of(math.prod(dims)))
    try:
        from jax.experimental import topologies

        description = topologies.get_topology_desc(
            topology_name=topology,
            platform='tpu',
            chip_config_name=generation.chip_config,
            chips_per_host_bounds=generation.chips_per_host,
            num_slices=num_slices,
            wrap=tuple(len(dims) == 3 and d >= 4 for d in (dims + [1, 1, 1])[:3]),
        )
    except Exception as e:  # libtpu missing or the shape unknown to it
        raise CompileError(
            f'cannot describe TPU topology {topology!r}: {str(e).splitlines()[0]}. '
            f'libtpu comes with `pip install -r {TPU_FILE}`.'
        ) from e
    return description.devices, generation.hbm_bytes


@dataclasses.dataclass(frozen=True)
class CompileReport:
    devices: int
    device_kind: str
    mesh: dict[str, int]
    argument_bytes: int  # per device: state + batch
    output_bytes: int
    temp_bytes: int
    alias_bytes: int  # outputs written in place of donated arguments
    hbm_bytes: int | None  # per device, when known
    model_flops_per_step: float  # all devices
    # XLA's cost analysis of one device's compiled program (recomputation included). It counts a
    # loop's body once (the layer scan, the microbatch loop): a measure to compare compiles of one
    # config by, not the step's total.
    hlo_flops: float
    hlo_bytes_accessed: float  # read and written

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def fits(self) -> bool:
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes

    def table(self) -> str:
        def gib(n):
            return f'{n / GiB:8.2f} GiB'

        rows = [
            ('devices', f'{self.devices} x {self.device_kind}'),
            ('mesh', str(self.mesh)),
            ('arguments / device', gib(self.argument_bytes)),
            ('outputs / device', gib(self.output_bytes)),
            ('temporaries / device', gib(self.temp_bytes)),
            ('aliased (donated)', gib(self.alias_bytes)),
            ('total / device', gib(self.total_bytes)),
            ('HBM / device', gib(self.hbm_bytes) if self.hbm_bytes else 'unknown'),
            ('fits', 'yes' if self.fits else 'NO'),
            ('model FLOPs / step', f'{self.model_flops_per_step:.3e}'),
        ]
        return '\n'.join(f'{k:<22}{v}' for k, v in rows)


def compile_train_step(config: Config, devices: Sequence[jax.Device], hbm_bytes: int | None) -> CompileReport:
    """Lowers and compiles the real train step for `devices` (no arrays are allocated)."""
    mesh = sharding.make_mesh(config.mesh, devices)
    check_fits_mesh(config, dict(mesh.shape))
    trainer = TrainSteps(config, mesh)
    shape = (config.data.batch_size, config.data.seq_len)
    batch = {
        k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
        for k in ('inputs', 'targets', 'loss_mask')
    }
    try:
        compiled = trainer.train_step.lower(trainer.abstract_state, batch).compile()
    except jax.errors.JaxRuntimeError as e:
        if 'RESOURCE_EXHAUSTED' not in str(e):
            raise
        raise CompileError(
            f'the train step does not fit {devices[0].device_kind} on mesh {dict(mesh.shape)}: '
            f'{str(e).splitlines()[0]} Lower data.batch_size, set model.remat=full, or shard '
            'more (mesh.fsdp / mesh.tensor).'
        ) from e
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    flops = accounting.training_flops_per_token(config.model, config.data.seq_len) * shape[0] * shape[1]
    return CompileReport(
        devices=len(devices),
        device_kind=devices[0].device_kind,
        mesh=dict(mesh.shape),
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        hbm_bytes=hbm_bytes,
        model_flops_per_step=flops,
        hlo_flops=cost.get('flops', 0.0),
        hlo_bytes_accessed=cost.get('bytes accessed', 0.0),
    )


def local_hbm_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get('bytes_limit')


def auto_fit(
    config: Config, devices: Sequence[jax.Device], hbm_bytes: int | None, say: Callable[[str], None] = print
) -> tuple[Config, CompileReport | None]:
    """`config` with train.microbatches=0 and model.remat='auto' resolved, and the report of the
    chosen step (None when nothing was auto). Microbatches come first (the fewest that fit with the
    most memory-saving remat allowed, by bisection: memory falls as they grow), then the cheapest
    remat at that count. Explicit values are kept. Each candidate is compiled (minutes each for a
    large model on a slice) and `say`s a line as it finishes. CompileError when no setting fits."""
    auto_microbatches, auto_remat = config.train.microbatches == 0, config.model.remat == 'auto'
    if not (auto_microbatches or auto_remat):
        return config, None
    mesh_shape = sharding.mesh_shape(config.mesh, len(devices))
    rows = config.data.batch_size // (mesh_shape['data'] * mesh_shape['fsdp'])  # sequences per device per step
    counts = [m for m in range(1, rows + 1) if rows % m == 0] if auto_microbatches else [config.train.microbatches]
    remats = REMAT_BY_COST if auto_remat else (config.model.remat,)

    def setting(count: int, remat: str) -> Config:
        return dataclasses.replace(
            config,
            train=dataclasses.replace(config.train, microbatches=count),
            model=dataclasses.replace(config.model, remat=remat),
        )

    reports: dict[tuple[int, str], CompileReport | None] = {}

    def fits(count: int, remat: str) -> bool:
        if (count, remat) not in reports:
            start, candidate = time.perf_counter(), f'auto fit: microbatches={count}, remat={remat}:'
            try:
                report = reports[count, remat] = compile_train_step(setting(count, remat), devices, hbm_bytes)
                verdict = 'fits' if report.total_bytes <= FIT_MARGIN * hbm_bytes else 'does not fit'
                say(
                    f'{candidate} {report.total_bytes / GiB:.2f} of {hbm_bytes / GiB:.2f} GiB per device, {verdict} '
                    f'(compiled in {time.perf_counter() - start:.0f} s)'
                )
            except CompileError as e:
                reports[count, remat] = None
                say(f'{candidate} does not compile ({e})')
        report = reports[count, remat]
        return report is not None and report.total_bytes <= FIT_MARGIN * hbm_bytes

    if hbm_bytes is None:  # no memory limit to fit (CPU): the cheapest setting
        return setting(counts[0], remats[0]), None
    lo, hi = 0, len(counts) - 1
    if not fits(counts[hi], remats[-1]):
        raise CompileError(
            f'the train step does not fit {devices[0].device_kind} ({hbm_bytes / GiB:.1f} GiB) at any '
            f'setting: even microbatches={counts[hi]} with remat={remats[-1]} does not. Lower data.batch_size '
            'or data.seq_len, shard more (mesh.fsdp / mesh.tensor), or use more devices.'
        )
    while lo < hi:  # the fewest microbatches that fit with the most memory-saving remat
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(counts[mid], remats[-1]) else (mid + 1, hi)
    count = counts[lo]
    remat = next(r for r in remats if fits(count, r))
    return setting(count, remat), reports[count, remat]


def fit_line(fitted: Config, report: CompileReport | None) -> str:
    """What auto_fit chose, in one line."""
    memory = (
        'device memory unknown, so the cheapest setting'
        if report is None
        else f'{report.total_bytes / GiB:.2f} of {report.hbm_bytes / GiB:.2f} GiB per device'
    )
    return f'auto fit: train.microbatches={fitted.train.microbatches}, model.remat={fitted.model.remat} ({memory})'


def execution(config: Config, platform: str, say: Callable[[str], None] = logging.info) -> Config:
    """The autos that need no compile, for `platform`: the model's (vrl/model/resolve.py) for the
    run's sequences, and optimizer.decay_steps=0 as train.steps."""
    data = config.data
    model = model_resolve.execution(
        config.model, platform, data.seq_len, data.document_masking, config.mesh.context, say
    )
    return dataclasses.replace(config, model=model, optimizer=_schedule_with_run(config.optimizer, config.train.steps))


def _schedule_with_run(optimizer: OptimizerConfig, steps: int) -> OptimizerConfig:
    """optimizer.decay_steps=0 as train.steps (after the warmup, at least). A wsd run too short for its
    warmup is a ConfigError naming train.steps, the warmup and the warmup that fits."""
    if optimizer.decay_steps:
        return optimizer
    decay_start = steps - round(optimizer.decay_fraction * steps)
    if optimizer.schedule == 'wsd' and 0 < steps and decay_start < optimizer.warmup_steps:
        raise ConfigError(
            f'train.steps={steps} is too short for optimizer.warmup_steps={optimizer.warmup_steps}: the wsd '
            f'schedule decays over the last {optimizer.decay_fraction:g} of the run, from step {decay_start}, '
            f'inside the warmup; set --config.optimizer.warmup_steps={min(steps // 4, decay_start)} (or more '
            'train.steps)'
        )
    return dataclasses.replace(optimizer, decay_steps=max(steps, optimizer.warmup_steps + 1))


def resolve(
    config: Config, devices: Sequence[jax.Device], hbm_bytes: int | None, say: Callable[[str], None] = print
) -> tuple[Config, CompileReport | None]:
    """Every auto setting of `config` for these devices (their memory: `hbm_bytes` per device, None
    if unknown), each choice said; and the chosen step's compile report where one was compiled."""
    if config.mesh.context == 0:
        return fit_context(config, devices, hbm_bytes, say)
    config = execution(config, devices[0].platform, say)
    if config.train.microbatches and config.model.remat != 'auto':
        return config, None
    fitted, report = auto_fit(config, devices, hbm_bytes, say)
    say(fit_line(fitted, report))
    return fitted, report


def fit_context(
    config: Config, devices: Sequence[jax.Device], hbm_bytes: int | None, say: Callable[[str], None] = print
) -> tuple[Config, CompileReport | None]:
    """`resolve` for mesh.context=0 (auto): each context size c that divides a slice's devices and
    data.seq_len, fewest devices per sequence first (each split adds the keys' and values' exchange),
    until the step fits; the mesh axis at -1 gives up the devices. Every other auto setting is
    resolved at each size (the attention kernel among them). Without a known memory limit (CPU),
    every sequence stays whole."""
    per_slice = len(devices) // config.mesh.slices
    sizes = [c for c in range(1, per_slice + 1) if per_slice % c == 0 and config.data.seq_len % c == 0]
    for context in sizes[:1] if hbm_bytes is None else sizes:
        candidate = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, context=context))
        try:
            check_fits_mesh(candidate, sharding.mesh_shape(candidate.mesh, len(devices)))
            fitted, report = resolve(candidate, devices, hbm_bytes, say)
            if hbm_bytes is not None:
                report = report or compile_train_step(fitted, devices, hbm_bytes)
                if report.total_bytes > FIT_MARGIN * hbm_bytes:
                    raise CompileError(f'{report.total_bytes / GiB:.2f} of {hbm_bytes / GiB:.2f} GiB per device')
        except (CompileError, ConfigError) as e:
            say(f'auto fit: mesh.context={context} does not fit ({" ".join(str(e).split())})')
            continue
        why = (
            'device memory unknown, so every sequence whole'
            if hbm_bytes is None
            else f'the fewest devices per sequence that fit: {report.total_bytes / GiB:.2f} GiB per device'
        )
        say(f'auto fit: mesh.context={context} ({why})')
        return fitted, report
    raise CompileError(
        f'the train step does not fit {devices[0].device_kind} at any mesh.context in {sizes} '
        "(the sizes that divide both a slice's devices and data.seq_len). Lower "
        'data.batch_size or data.seq_len, or use more devices.'
    )
