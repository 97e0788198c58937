"""Parameter counts, training FLOPs and KV-cache size from a ModelConfig alone (no weights).

The counts mirror `vrl.model.Decoder` exactly; tests/test_accounting.py holds them to the
real module's parameters.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from vrl.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ModelAccount:
    params: int  # every parameter allocated, with the padded vocabulary
    params_unpadded: int  # the same with vocab_size rows/columns instead of the padded count
    non_embedding_params: int  # params minus the input embedding and the output head
    matmul_params: int  # weights used in a matmul per token: non-embedding ones + the head
    flops_per_token: float  # training (forward + backward), see `training_flops_per_token`
    kv_cache_bytes_per_token: int  # one sequence, all layers, compute dtype


def _layer_params(cfg: ModelConfig, has_value_proj: bool) -> int:
    D, H, K, Dh, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    attention = D * H * Dh * 2 + D * K * Dh * (2 if has_value_proj else 1)
    return attention + 3 * D * F + 2 * D  # + SwiGLU + two RMSNorm scales


def _lambda_params(cfg: ModelConfig) -> int:
    if cfg.attention != 'resformer':
        return 0
    return {'learnable': 2 * cfg.n_stacked, 'learnable_plus': 2 * cfg.n_stacked + 1}.get(cfg.lambda_mode, 0)


def _vocab_params(cfg: ModelConfig, vocab: int) -> int:
    return vocab * cfg.d_model * (1 if cfg.tie_embeddings else 2)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 * matmul_params + 6 * L * H * Dh * seq_len.

    The first term is the forward (2 FLOPs per multiply-add) and backward (twice the
    forward) of every weight matmul, the output head included. The second is the same for
    the two attention matmuls (QK^T and AV), each 2 * Dh FLOPs per query-key pair per head,
    with seq_len / 2 keys per query on average under the causal mask.
    """
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def non_embedding_params(cfg: ModelConfig) -> int:
    layers = _layer_params(cfg, True) + cfg.n_stacked * _layer_params(cfg, cfg.attention != 'svformer')
    return layers + cfg.d_model + _lambda_params(cfg)  # + final norm


def matmul_params(cfg: ModelConfig) -> int:
    D, H, K, Dh, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    value_projections = 1 if cfg.attention == 'svformer' else cfg.n_layers
    per_layer = 2 * D * H * Dh + D * K * Dh + 3 * D * F
    return cfg.n_layers * per_layer + value_projections * D * K * Dh + D * cfg.padded_vocab_size


def kv_cache_bytes_per_token(cfg: ModelConfig) -> int:
    """K for every layer; V for every layer, or once for SVFormer (all layers share V_1)."""
    value_layers = 1 if cfg.attention == 'svformer' else cfg.n_layers
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    return (cfg.n_layers + value_layers) * cfg.n_kv_heads * cfg.head_dim * itemsize


def account(cfg: ModelConfig, seq_len: int) -> ModelAccount:
    non_embedding = non_embedding_params(cfg)
    return ModelAccount(
        params=non_embedding + _vocab_params(cfg, cfg.padded_vocab_size),
        params_unpadded=non_embedding + _vocab_params(cfg, cfg.vocab_size),
        non_embedding_params=non_embedding,
        matmul_params=matmul_params(cfg),
        flops_per_token=training_flops_per_token(cfg, seq_len),
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(cfg),
    )
