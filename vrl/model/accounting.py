"""Parameter counts, training FLOPs and KV-cache size from a ModelConfig alone (no weights).

Parameters are read from the abstract model (`parameters`: Decoder under nnx.eval_shape, nothing
allocated) with their logical axes: the vocabulary's by the `vocab` axis, the matmul weights as those that
map between d_model and heads or the MLP. A residual method (vrl/model/residual/) adds its own matmul
weights, mixes, history and constant parameters through its hooks. tests/test_accounting.py holds the
counts to hand formulas and the FLOPs to XLA's cost analysis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax.numpy as jnp

from vrl.core.sharding import Axis
from vrl.model import residual, resolve
from vrl.model.cache import layout_of
from vrl.model.config import ModelConfig


class Parameter(NamedTuple):
    """One parameter of the abstract model: its path, shape and logical axes."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@functools.cache
def parameters(cfg: ModelConfig) -> tuple[Parameter, ...]:
    """Every parameter of the Decoder for `cfg` with its logical axes, from the abstract model (nothing
    allocated; cached per config)."""
    from flax import nnx

    from vrl.model.decoder import Decoder

    state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return tuple(
        Parameter(tuple(map(str, path)), tuple(variable.shape), tuple(variable.out_sharding or ()))
        for path, variable in nnx.to_flat_state(state)
    )


@functools.cache
def _methods(cfg: ModelConfig) -> frozenset[str]:
    """The attribute names the residual method's parameters sit under (in the Decoder and in each Block;
    cached per config, as `parameters` is: both build abstract modules)."""
    from flax import nnx

    method = residual.of(cfg)
    owned = nnx.eval_shape(
        lambda: (method.model_params(nnx.Rngs(0)), method.block_params(first=False, stack=1, rngs=nnx.Rngs(0)))
    )
    return frozenset({*owned[0], *owned[1]})


def _is_matmul_weight(p: Parameter, methods: frozenset[str]) -> bool:
    """A weight the model multiplies each token by once: it maps d_model to heads or the MLP (or back), is no
    vocabulary lookup, and is not the residual method's (which counts its own)."""
    axes = set(p.axes)
    own = p.path[0] in methods or (p.path[0] in ('first', 'layers') and p.path[1] in methods)
    return Axis.EMBED in axes and bool(axes & {Axis.HEADS, Axis.KV_HEADS, Axis.MLP}) and not own


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


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 * (matmul_params + the residual method's mix_macs) + 12 * H * Dh * (keys per query, summed over
    layers); without local layers and a residual method, 6 * matmul_params + 6 * L * H * Dh * seq_len.

    The first term is the forward (2 FLOPs per multiply-add) and backward (twice the forward) of every
    weight matmul, the output head included, and of the residual method's mixes (MUDD's weighted sums,
    hyper-connections' weights and mixes, attention residuals' dots and mixes: vrl/model/residual/). The
    second is the same for the two attention matmuls (QK^T and AV), each 2 * Dh FLOPs per query-key pair per
    head, with the mask's pairs less half its diagonal per query: seq_len / 2 under the causal mask,
    W - 1/2 - W (W - 1) / (2 seq_len) in a local layer (W = min(model.attention_window, seq_len)).
    Elementwise work (the value mixes, NeuTRENO, DenseFormer's average, norms, Sinkhorn) and lookups (value
    embeddings) are not counted.
    """
    W, S = min(cfg.attention_window, seq_len), seq_len
    keys = sum(W - 0.5 - W * (W - 1) / (2 * S) if local else S / 2 for local in cfg.local_layers)
    macs = matmul_params(cfg) + residual.of(cfg).mix_macs()
    return 6.0 * macs + 12.0 * cfg.n_heads * cfg.head_dim * keys


def matmul_params(cfg: ModelConfig) -> int:
    """The weights each token is multiplied by once: the abstract model's matmul weights (`_is_matmul_weight`),
    the residual method's (MUDD's W_in, W_out) and the output head (D x padded vocabulary, tied or not)."""
    methods = _methods(cfg)
    weights = sum(p.size for p in parameters(cfg) if _is_matmul_weight(p, methods))
    return weights + residual.of(cfg).matmul_params() + cfg.d_model * cfg.padded_vocab_size


def _vocab_params(cfg: ModelConfig) -> int:
    """The padded vocabulary's parameters: the embedding, the head unless tied, the value-embedding tables."""
    return sum(p.size for p in parameters(cfg) if Axis.VOCAB in p.axes)


def non_embedding_params(cfg: ModelConfig) -> int:
    """Every parameter but the vocabulary's."""
    return sum(p.size for p in parameters(cfg)) - _vocab_params(cfg)


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
    """What a forward holds per token beside the hidden state for the residual method's mixes (its
    `history_vectors` of D: DenseFormer's and MUDD's embedding and block outputs, MUDD's q, k, v ways,
    hyper-connections' streams beyond one, attention residuals' sources) in the compute dtype; 0 for the
    plain stream. Decoding holds it for a step's new tokens only (the KV cache is unchanged). The training
    step keeps a depth history for the backward pass once (vrl/model/history_scan.py; once per stacked
    layer while layer statistics are recorded); hyper-connections' streams once per layer, as every
    variant's hidden state."""
    vectors = residual.of(cfg).history_vectors()
    return vectors * cfg.d_model * jnp.dtype(resolve.local_compute_dtype(cfg)).itemsize


def max_batch_for_cache(cfg: ModelConfig, context: int, memory_bytes: float) -> int:
    """The most sequences of `context` tokens whose KV cache fits in `memory_bytes`."""
    return int(memory_bytes // kv_cache_bytes(cfg, context))


def vanilla_mha(cfg: ModelConfig) -> ModelConfig:
    """The same shape as plain multi-head attention: the reference for cache and parameter ratios."""
    return dataclasses.replace(cfg.as_vanilla(), n_kv_heads=cfg.n_heads)


def account(cfg: ModelConfig, seq_len: int) -> ModelAccount:
    non_embedding, vocab = non_embedding_params(cfg), _vocab_params(cfg)
    return ModelAccount(
        params=non_embedding + vocab,
        params_unpadded=non_embedding + vocab // cfg.padded_vocab_size * cfg.vocab_size,
        non_embedding_params=non_embedding,
        matmul_params=matmul_params(cfg),
        flops_per_token=training_flops_per_token(cfg, seq_len),
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(cfg),
        constant_params=residual.of(cfg).constant_params(),
    )
