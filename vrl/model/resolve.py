"""The model's `auto` settings for a platform, each choice said with its reason (cheap and idempotent: a
TrainSteps applies `execution` to the config it is given).

    model.attention_impl   the platform's attention kernel (splash on TPU, cuDNN on NVIDIA GPUs) where it
                           serves the config, else xla (vrl/model/attention.py says what each kernel needs)
    model.hand_vjp         the ops whose hand-written backward pays on the platform (vrl/model/ops.py)
    model.compute_dtype    bfloat16 on accelerators and on CPUs with bf16 dot instructions (AVX512_BF16,
                           AMX: vrl/core/backend.py reads the ISA), float32 on other CPUs, where a bf16 dot runs
                           at the float32 rate plus conversions (docs/performance.md)

train.microbatches=0 and model.remat=auto need the compiled train step: vrl/train/aot.py's `resolve`
applies `execution`, then fits those two. The code that uses a setting takes only resolved values
and refuses `auto` by name.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax

from vrl.core import backend
from vrl.core.config import Config, ConfigError, ModelConfig, OptimizerConfig
from vrl.model import attention, ops

Say = Callable[[str], None]


def compute_dtype(model: ModelConfig, platform: str, cpu_isa: str | None = None) -> tuple[str, str]:
    """(model.compute_dtype resolved for `platform`, why); on a CPU, for `cpu_isa` (vrl.core.backend.cpu_isa()'s
    name; read from this host when None)."""
    isa = (cpu_isa or backend.cpu_isa() or 'unknown') if platform == 'cpu' else None
    slow_bf16 = isa is not None and isa not in backend.NATIVE_BF16_DOT_ISAS
    if model.compute_dtype == 'bfloat16' and slow_bf16:
        return 'bfloat16', f'as configured, though CPU ISA {isa} has no bf16 dot instructions (float32 is faster)'
    if model.compute_dtype != 'auto':
        return model.compute_dtype, 'as configured'
    if slow_bf16:
        return 'float32', f'CPU ISA {isa} has no bf16 dot instructions: a bfloat16 step runs slower there'
    return 'bfloat16', f'CPU ISA {isa} has bf16 dot instructions' if isa else f'{platform} matmuls run bfloat16'


def local_compute_dtype(model: ModelConfig) -> str:
    """model.compute_dtype as it resolves for this process's backend (what accounting and estimates use)."""
    return compute_dtype(model, jax.default_backend())[0]


def execution(config: Config, platform: str, say: Say = logging.info) -> Config:
    """model.compute_dtype, model.attention_impl and model.hand_vjp for `platform` ('cpu', 'gpu', 'tpu'),
    and optimizer.decay_steps=0 as train.steps; an explicit value that cannot run there is a
    ConfigError with the reason."""
    dtype, why_dtype = compute_dtype(config.model, platform)
    model = dataclasses.replace(config.model, compute_dtype=dtype)  # cuDNN attention needs bfloat16
    impl, why_impl = attention.choose(
        model, platform, config.data.seq_len, config.data.document_masking, config.mesh.context
    )
    hand_vjp, why_vjp = ops.choose_hand_vjp(model.hand_vjp, platform)
    for field, new, why in (
        ('compute_dtype', dtype, why_dtype),
        ('attention_impl', impl, why_impl),
        ('hand_vjp', hand_vjp, why_vjp),
    ):
        old = getattr(config.model, field)
        if new != old or why != 'as configured':  # a change, or an explicit value with a note
            say(f'model.{field}={new} ({old} on {platform}: {why})')
    return dataclasses.replace(
        config,
        model=dataclasses.replace(model, attention_impl=impl, hand_vjp=hand_vjp),
        optimizer=_schedule_with_run(config.optimizer, config.train.steps),
    )


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
