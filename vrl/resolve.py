"""Every `auto` setting, resolved in one place before a Trainer is built, each choice said with its reason.

    model.attention_impl   the platform's attention kernel (splash on TPU, cuDNN on NVIDIA GPUs) where it
                           serves the config, else xla (vrl/attention.py says what each kernel needs)
    model.hand_vjp         the ops whose hand-written backward pays on the platform (vrl/ops.py)
    model.compute_dtype    bfloat16 on accelerators and on CPUs with bf16 dot instructions (AVX512_BF16,
                           AMX: vrl/backend.py reads the ISA), float32 on other CPUs, where a bf16 dot runs
                           at the float32 rate plus conversions (docs/performance.md)
    train.microbatches=0,  the fewest microbatches, then the cheapest remat, whose compiled step fits the
    model.remat=auto       devices' memory (vrl/aot.py; 1 and none where no memory limit is known)

`execution` is cheap and idempotent (a Trainer applies it to what it is given); `memory` compiles
candidate steps. The code that uses a setting takes only resolved values and refuses `auto` by name.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import jax

from vrl import attention, backend, ops
from vrl.config import Config, ModelConfig

Say = Callable[[str], None]


def compute_dtype(model: ModelConfig, platform: str, cpu_isa: str | None = None) -> tuple[str, str]:
    """(model.compute_dtype resolved for `platform`, why); on a CPU, for `cpu_isa` (vrl.backend.cpu_isa()'s
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
    """model.compute_dtype, model.attention_impl and model.hand_vjp for `platform` ('cpu', 'gpu', 'tpu');
    an explicit value that cannot run there is a ConfigError with the reason."""
    dtype, why_dtype = compute_dtype(config.model, platform)
    model = dataclasses.replace(config.model, compute_dtype=dtype)  # cuDNN attention needs bfloat16
    impl, why_impl = attention.choose(model, platform, config.data.seq_len, config.data.document_masking)
    hand_vjp, why_vjp = ops.choose_hand_vjp(model.hand_vjp, platform)
    for field, new, why in (('compute_dtype', dtype, why_dtype), ('attention_impl', impl, why_impl),
                            ('hand_vjp', hand_vjp, why_vjp)):
        old = getattr(config.model, field)
        if new != old or why != 'as configured':  # a change, or an explicit value with a note
            say(f'model.{field}={new} ({old} on {platform}: {why})')
    return dataclasses.replace(config, model=dataclasses.replace(model, attention_impl=impl, hand_vjp=hand_vjp))


def memory(config: Config, devices: Sequence[jax.Device], hbm_bytes: int | None, say: Say = print
           ) -> tuple[Config, Any]:
    """train.microbatches=0 and model.remat=auto, by compiling candidate steps for `devices` (each
    candidate said as it compiles, then the choice); explicit values are kept. Also the chosen
    step's aot.CompileReport, when one was compiled (None otherwise)."""
    if config.train.microbatches and config.model.remat != 'auto':
        return config, None
    from vrl import aot  # it builds Trainers, which use this module
    fitted, report = aot.auto_fit(config, devices, hbm_bytes, say)
    say(aot.fit_line(fitted, report))
    return fitted, report


def resolve(config: Config, devices: Sequence[jax.Device], hbm_bytes: int | None, say: Say = print
            ) -> tuple[Config, Any]:
    """Every auto setting of `config` for these devices (their memory: `hbm_bytes` per device, None
    if unknown), and the chosen step's compile report where `memory` compiled one."""
    return memory(execution(config, devices[0].platform, say), devices, hbm_bytes, say)
