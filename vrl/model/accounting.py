"""Parameter counts, training FLOPs and KV-cache size from a ModelConfig alone (no weights).

The counts mirror `vrl.model.decoder.Decoder` exactly; tests/test_accounting.py holds them to the
real module's parameters.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from vrl.model import resolve
from vrl.model.cache import layout_of
from vrl.model.config import ModelConfig
from vrl.model.residual import attnres


@dataclasses.dataclass(frozen=True)
class ModelAccount:
    params: int  # every parameter allocated, with the padded vocabulary
    params_unpadded: int  # the same with vocab_size rows/columns instead of the padded count
    non_embedding_params: int  # params minus the input embedding, the output head and value-embedding tables
    matmul_params: int  # weights used in a matmul per token: non-embedding ones + the head
    flops_per_token: float  # training (forward + backward), see `training_flops_per_token`
    kv_cache_bytes_per_token: int  # one sequence, all layers, compute dtype
    # of `params`, those that never get a gradient: Attention Residuals' first query and its key scale
    # weigh a single source (the embedding), whose softmax weight is 1 whatever they hold (docs/variants.md)
    constant_params: int = 0


def _slot_heads(cfg: ModelConfig, ring: bool | None = None) -> int:
    """The kv heads of every cache slot (those that are ring buffers, or not, where `ring` says): also
    W_K's and W_V's heads, one projection per slot (CLA shares them per group, SVFormer has one W_V,
    SkipV1Former's later W_V project K - model.skip_v1 heads)."""
    slots = layout_of(cfg)
    heads = [(slots.kv_heads, slots.ring_slot('k', slot)) for slot in range(slots.n_key_slots)]
    heads += [(slots.value_heads(slot), slots.ring_slot('v', slot)) for slot in range(slots.n_value_slots)]
    return sum(n for n, is_ring in heads if ring is None or is_ring == ring)


def _gate_matrices(cfg: ModelConfig) -> int:
    """(D, K) gates: the per-token mix's W_mix in layers 2..L, a gate per value-embedding layer."""
    per_token = cfg.per_token_mix
    return (cfg.n_stacked if per_token else 0) + len(cfg.value_embed_layers)


def _mudd_connections(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(inputs x ways, hidden width) of each MUDD connection: after 0-based layer i, (i + 2) len(ways)."""
    return [((i + 2) * len(cfg.mudd_after(i)), cfg.mudd_hidden(i)) for i in range(cfg.n_layers) if cfg.mudd_after(i)]


def _hyper_params(cfg: ModelConfig) -> int:
    """Hyper-connections, per sublayer (2 L): static pre (n), post (n) and res (n, n); dynamic, hc: a norm
    scale (D), W (D, n + 2) and 2 gates; mhc: a norm scale (n D), phi (n D, 2 n + n^2) and 3 gates."""
    n, D = cfg.hyper_streams, cfg.d_model
    if cfg.residual not in ('hc', 'mhc'):
        return 0
    dynamic = {'hc': D + D * (n + 2) + 2, 'mhc': n * D + n * D * (2 * n + n * n) + 3}[cfg.residual]
    return 2 * cfg.n_layers * (2 * n + n * n + (dynamic if cfg.hyper_dynamic else 0))


def _hyper_macs(cfg: ModelConfig) -> int:
    """Hyper-connections' multiply-adds per token, per sublayer: the dynamic weights (hc: W on each of the
    n streams, n D (n + 2); mhc: phi once, n D (2 n + n^2)) and the mixes: the input (n D), the remix
    (n^2 D) and the output added to each stream (n D)."""
    n, D = cfg.hyper_streams, cfg.d_model
    if cfg.residual not in ('hc', 'mhc'):
        return 0
    dynamic = {'hc': n * D * (n + 2), 'mhc': n * D * (2 * n + n * n)}[cfg.residual]
    return 2 * cfg.n_layers * ((dynamic if cfg.hyper_dynamic else 0) + (n * n + 2 * n) * D)


def _attn_residual_params(cfg: ModelConfig) -> int:
    """Attention residuals: a query and a key-norm scale (D each) per sublayer (2 L) and for the output."""
    return (2 * cfg.n_layers + 1) * 2 * cfg.d_model if cfg.residual == 'attnres' else 0


def _attn_residual_macs(cfg: ModelConfig) -> int:
    """Attention residuals' multiply-adds per token: each query's dot with every normalised source it
    weighs, and their weighted sum, D each per source."""
    return 2 * cfg.d_model * sum(attnres.sources_per_sublayer(cfg)) if cfg.residual == 'attnres' else 0


def _scalar_params(cfg: ModelConfig) -> int:
    """ResFormer's learnable lambdas, DenseFormer's L (L + 3) / 2 averaging weights and MUDD's static weights."""
    lambdas = 0
    if cfg.attention == 'resformer':
        lambdas = {'learnable': 2 * cfg.n_stacked, 'learnable_plus': 2 * cfg.n_stacked + 1}.get(cfg.lambda_mode, 0)
    L = cfg.n_layers
    mudd_static = sum(weights for weights, _ in _mudd_connections(cfg))
    return lambdas + (L * (L + 3) // 2 if cfg.residual == 'dense' else 0) + mudd_static


def _vocab_params(cfg: ModelConfig, vocab: int) -> int:
    """The embedding, the head unless tied, and the value-embedding tables (vocab x K x Dh each)."""
    tables = max(cfg.value_embed_table_ids, default=-1) + 1
    return vocab * (cfg.d_model * (1 if cfg.tie_embeddings else 2) + tables * cfg.n_kv_heads * cfg.head_dim)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 * matmul_params + 12 * H * Dh * (keys per query, summed over layers); without local layers
    6 * matmul_params + 6 * L * H * Dh * seq_len.

    The first term is the forward (2 FLOPs per multiply-add) and backward (twice the
    forward) of every weight matmul, the output head included. The second is the same for
    the two attention matmuls (QK^T and AV), each 2 * Dh FLOPs per query-key pair per head,
    with the mask's pairs less half its diagonal per query: seq_len / 2 under the causal mask,
    W - 1/2 - W (W - 1) / (2 seq_len) in a local layer (W = min(model.attention_window, seq_len)).
    MUDD adds its W_in and W_out as matmul weights and its mixes, len(ways) (i + 2) D multiply-adds
    per token after layer i, hyper-connections their weights and mixes (`_hyper_macs`) and attention
    residuals their queries' dots and mixes (`_attn_residual_macs`), each multiply-add 6 FLOPs in
    training like a weight's. Elementwise work (the value mixes, NeuTRENO,
    DenseFormer's one average of the same kind, norms, Sinkhorn) and lookups (value embeddings) are
    not counted.
    """
    W, S = min(cfg.attention_window, seq_len), seq_len
    keys = sum(W - 0.5 - W * (W - 1) / (2 * S) if local else S / 2 for local in cfg.local_layers)
    mudd_mixes = sum(weights for weights, _ in _mudd_connections(cfg)) * cfg.d_model
    macs = matmul_params(cfg) + mudd_mixes + _hyper_macs(cfg) + _attn_residual_macs(cfg)
    return 6.0 * macs + 12.0 * cfg.n_heads * cfg.head_dim * keys


def matmul_params(cfg: ModelConfig) -> int:
    D, H, K, Dh, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    per_layer = 2 * D * H * Dh + 3 * D * F  # W_Q, W_O, SwiGLU
    return (
        cfg.n_layers * per_layer
        + _slot_heads(cfg) * D * Dh
        + _gate_matrices(cfg) * D * K
        + sum(hidden * (D + weights) for weights, hidden in _mudd_connections(cfg))  # MUDD's W_in, W_out
        + D * cfg.padded_vocab_size
    )


def non_embedding_params(cfg: ModelConfig) -> int:
    norms = (
        2 * cfg.n_layers + 1 + cfg.n_stacked * sum(way in cfg.mudd_ways[:-1] for way in 'kv' if cfg.residual == 'mudd')
    ) * cfg.d_model
    if cfg.qk_norm:  # a query scale per layer, a key scale per layer that projects keys
        norms += (cfg.n_layers + sum(map(layout_of(cfg).owns_kv, range(cfg.n_layers)))) * cfg.head_dim
    cross_layer = _hyper_params(cfg) + _attn_residual_params(cfg)
    return matmul_params(cfg) - cfg.d_model * cfg.padded_vocab_size + norms + _scalar_params(cfg) + cross_layer


def _head_row_bytes(cfg: ModelConfig) -> int:
    """One position of one kv head: Dh in the compute dtype (`auto`: as it resolves on this process's
    backend)."""
    return cfg.head_dim * jnp.dtype(resolve.local_compute_dtype(cfg)).itemsize


def kv_cache_bytes_per_token(cfg: ModelConfig) -> int:
    """What each position adds to one sequence's cache: a vector per kv head of each slot that holds
    every position (the ring buffers of local layers hold a fixed window: `kv_cache_bytes`)."""
    return _slot_heads(cfg, ring=False) * _head_row_bytes(cfg)


def served_kv_cache_bytes_per_token(cfg: ModelConfig) -> int:
    """What each position adds to one sequence's cache in the Hugging Face export and vLLM, whose slots all
    hold every position (a local layer's keys too: no ring buffers); otherwise the same slots as vrl's."""
    return _slot_heads(cfg) * _head_row_bytes(cfg)


def kv_cache_bytes(cfg: ModelConfig, context: int) -> int:
    """One sequence's cache at `context` positions: the whole slots' `context` positions and each ring
    buffer's min(model.attention_window, context)."""
    ring = _slot_heads(cfg, ring=True) * min(cfg.attention_window, context) * _head_row_bytes(cfg)
    return kv_cache_bytes_per_token(cfg) * context + ring


def layer_history_bytes_per_token(cfg: ModelConfig) -> int:
    """What a forward holds per token beside the hidden state for the cross-layer mixes (DenseFormer,
    MUDD, hyper-connections, attention residuals): the embedding output and every block output, L + 1
    vectors of D, and MUDD's mixed query, key and value inputs; or hyper-connections' n - 1 streams
    beyond one; or attention residuals' sources (2 L + 1, or N + 1 for blocks); in the
    compute dtype; 0 for the other variants. Decoding holds it for a step's new tokens only (the KV
    cache is unchanged). The training step keeps DenseFormer's, MUDD's and attention residuals' for
    the backward pass once under model.remat (vrl/model/history_scan.py), once per stacked layer
    without; hyper-connections' streams once per layer, as every variant's hidden state."""
    if cfg.residual in ('hc', 'mhc'):
        vectors = cfg.hyper_streams - 1
    elif cfg.residual in ('dense', 'mudd'):
        vectors = cfg.n_layers + 1 + (len(cfg.mudd_ways) - 1 if cfg.residual == 'mudd' else 0)
    elif cfg.residual == 'attnres':
        vectors = attnres.n_sources(cfg)
    else:
        return 0
    return vectors * cfg.d_model * jnp.dtype(resolve.local_compute_dtype(cfg)).itemsize


def max_batch_for_cache(cfg: ModelConfig, context: int, memory_bytes: float) -> int:
    """The most sequences of `context` tokens whose KV cache fits in `memory_bytes`."""
    return int(memory_bytes // kv_cache_bytes(cfg, context))


def vanilla_mha(cfg: ModelConfig) -> ModelConfig:
    """The same shape as plain multi-head attention: the reference for cache and parameter ratios."""
    return dataclasses.replace(cfg.as_vanilla(), n_kv_heads=cfg.n_heads)


def account(cfg: ModelConfig, seq_len: int) -> ModelAccount:
    non_embedding = non_embedding_params(cfg)
    return ModelAccount(
        params=non_embedding + _vocab_params(cfg, cfg.padded_vocab_size),
        params_unpadded=non_embedding + _vocab_params(cfg, cfg.vocab_size),
        non_embedding_params=non_embedding,
        matmul_params=matmul_params(cfg),
        flops_per_token=training_flops_per_token(cfg, seq_len),
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(cfg),
        constant_params=_constant_params(cfg),
    )


def _constant_params(cfg: ModelConfig) -> int:
    """Attention Residuals' first query and key scale (D each), when it weighs one source: the embedding."""
    single = cfg.residual == 'attnres' and attnres.sources_per_sublayer(cfg)[0] == 1
    return 2 * cfg.d_model if single else 0
