"""Ahead-of-time compilation of the real train step, for the local devices or a TPU slice.

    python -m vrl.main --config=configs/svformer_468m.py --compile_only --topology=v5e:4x4

With `libtpu` installed (`pip install "jax[tpu]"`), `jax.experimental.topologies` describes a
TPU slice on any machine, so the step is compiled for that slice's devices and mesh without a
TPU, and XLA's memory analysis says whether it fits each chip's HBM.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from vrl import accounting, sharding
from vrl.config import Config
from vrl.step import Trainer

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    chip_config: str  # 'megacore': one device per chip of two TensorCores
    chips_per_host: tuple[int, int, int]
    hbm_bytes: int  # per chip


TPU_GENERATIONS = {
    'v4': TpuGeneration('megacore', (2, 2, 1), 32 * GiB),
    'v5e': TpuGeneration('default', (2, 2, 1), 16 * GiB),
    'v5p': TpuGeneration('megacore', (2, 2, 1), 95 * GiB),
    'v6e': TpuGeneration('default', (2, 2, 1), 32 * GiB),
}


class CompileError(ValueError):
    """A topology that cannot be described, or a step that does not fit."""


def tpu_devices(topology: str) -> tuple[Sequence[jax.Device], int]:
    """The devices of a slice such as 'v5e:4x4' or 'v5p:2x2x2', and the HBM of each chip."""
    generation_name, _, shape = topology.partition(':')
    generation = TPU_GENERATIONS.get(generation_name)
    if generation is None or not shape:
        raise CompileError(f'--topology={topology!r} is invalid: allowed GENERATION:SHAPE with GENERATION '
                           f'one of {sorted(TPU_GENERATIONS)}, e.g. v5e:4x4 or v5p:2x2x2.')
    dims = [int(d) for d in shape.split('x')]
    try:
        from jax.experimental import topologies
        description = topologies.get_topology_desc(
            topology_name=topology, platform='tpu', chip_config_name=generation.chip_config,
            chips_per_host_bounds=generation.chips_per_host, num_slices=1,
            wrap=tuple(len(dims) == 3 and d >= 4 for d in (dims + [1, 1, 1])[:3]))
    except Exception as e:  # libtpu missing or the shape unknown to it
        raise CompileError(f'cannot describe TPU topology {topology!r}: {str(e).splitlines()[0]}. '
                           'Install libtpu with `pip install "jax[tpu]==<your jax version>"`.') from e
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

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def fits(self) -> bool:
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes

    def table(self) -> str:
        def gib(n):
            return f'{n / GiB:8.2f} GiB'
        rows = [('devices', f'{self.devices} x {self.device_kind}'), ('mesh', str(self.mesh)),
                ('arguments / device', gib(self.argument_bytes)), ('outputs / device', gib(self.output_bytes)),
                ('temporaries / device', gib(self.temp_bytes)), ('aliased (donated)', gib(self.alias_bytes)),
                ('total / device', gib(self.total_bytes)),
                ('HBM / device', gib(self.hbm_bytes) if self.hbm_bytes else 'unknown'),
                ('fits', 'yes' if self.fits else 'NO'),
                ('model FLOPs / step', f'{self.model_flops_per_step:.3e}')]
        return '\n'.join(f'{k:<22}{v}' for k, v in rows)


def compile_train_step(config: Config, devices: Sequence[jax.Device], hbm_bytes: int | None) -> CompileReport:
    """Lowers and compiles the real train step for `devices` (no arrays are allocated)."""
    mesh = sharding.make_mesh(config.mesh, devices)
    sharding.check_fits_mesh(config, mesh.devices.shape)
    trainer = Trainer(config, mesh)
    shape = (config.data.batch_size, config.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
             for k in ('inputs', 'targets', 'loss_mask')}
    try:
        compiled = trainer.train_step.lower(trainer.abstract_state, batch).compile()
    except jax.errors.JaxRuntimeError as e:
        if 'RESOURCE_EXHAUSTED' not in str(e):
            raise
        raise CompileError(f'the train step does not fit {devices[0].device_kind} on mesh {dict(mesh.shape)}: '
                           f'{str(e).splitlines()[0]} Lower data.batch_size, set model.remat=full, or shard '
                           'more (mesh.fsdp / mesh.tensor).') from e
    memory = compiled.memory_analysis()
    flops = accounting.training_flops_per_token(config.model, config.data.seq_len) * shape[0] * shape[1]
    return CompileReport(
        devices=len(devices), device_kind=devices[0].device_kind, mesh=dict(mesh.shape),
        argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
        hbm_bytes=hbm_bytes, model_flops_per_step=flops)


def local_hbm_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get('bytes_limit')
