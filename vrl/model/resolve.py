"""The model's `auto` settings for a platform, each choice said with its reason (cheap and idempotent).

    model.attention_impl   the platform's attention kernel (splash on TPU, cuDNN on NVIDIA GPUs) where it
                           serves the config, else xla (vrl/model/attention.py says what each kernel needs)
    model.hand_vjp         the ops whose hand-written backward pays on the platform (vrl/model/ops.py)
    model.compute_dtype    bfloat16 on accelerators and on CPUs with bf16 dot instructions (AVX512_BF16,
                           AMX: vrl/core/backend.py reads the ISA), float32 on other CPUs, where a bf16 dot runs
                           at the float32 rate plus conversions (docs/performance.md)

A run resolves every auto once, in its plan: vrl/train/aot.py's `resolve` applies `execution`, then
fits train.microbatches=0, model.remat=auto and mesh.context=0 by compiling the train step. A model
runs on concrete values only (vrl.core.config.require_resolved, where the Decoder starts).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax

from vrl.core import backend
from vrl.model import attention, ops
from vrl.model.config import ModelConfig

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


def execution(
    model: ModelConfig, platform: str, seq_len: int, document_masking: bool, context: int, say: Say = logging.info
) -> ModelConfig:
    """model.compute_dtype, model.attention_impl and model.hand_vjp for `platform` ('cpu', 'gpu', 'tpu')
    and the sequences it runs (`seq_len` tokens, split over `context` devices; `document_masking`),
    each change said; an explicit value that cannot run there is a ConfigError with the reason."""
    dtype, why_dtype = compute_dtype(model, platform)
    typed = dataclasses.replace(model, compute_dtype=dtype)  # cuDNN attention needs bfloat16
    impl, why_impl = attention.choose(typed, platform, seq_len, document_masking, context)
    hand_vjp, why_vjp = ops.choose_hand_vjp(model.hand_vjp, platform)
    for field, new, why in (
        ('compute_dtype', dtype, why_dtype),
        ('attention_impl', impl, why_impl),
        ('hand_vjp', hand_vjp, why_vjp),
    ):
        old = getattr(model, field)
        if new != old or why != 'as configured':  # a change, or an explicit value with a note
            say(f'model.{field}={new} ({old} on {platform}: {why})')
    return dataclasses.replace(typed, attention_impl=impl, hand_vjp=hand_vjp)
