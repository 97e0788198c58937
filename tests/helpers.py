"""Small shared builders for the tests."""

from __future__ import annotations

import dataclasses

from vrl.config import ModelConfig


def small_model_config(**overrides) -> ModelConfig:
    """A 3-layer GQA model in float32: big enough to exercise every path, fast on CPU."""
    base = ModelConfig(vocab_size=97, vocab_pad_multiple=32, n_layers=3, d_model=32, n_heads=4,
                       n_kv_heads=2, head_dim=8, d_ff=48, compute_dtype='float32')
    return dataclasses.replace(base, **overrides)


# Every variant, and every ResFormer lambda mode.
VARIANTS = [
    dict(attention='vanilla'),
    dict(attention='svformer'),
    dict(attention='resformer', lambda_mode='identity'),
    dict(attention='resformer', lambda_mode='constant', lambda1=1.5, lambda2=0.7),
    dict(attention='resformer', lambda_mode='learnable'),
    dict(attention='resformer', lambda_mode='learnable_plus'),
    dict(attention='resformer', lambda_mode='sparse', sparse_layers=(3,), lambda1=5.0),
]
VARIANT_IDS = ['-'.join(str(v) for v in d.values()) for d in VARIANTS]
