"""Attention concentration and the states behind it, per layer (docs/paper.md, 'How the paper measures concentration').

Pure functions of one layer's arrays; `Decoder.layer_stats` calls them inside each layer, so
only one layer's (L x S) attention maps exist at a time. Each statistic is one float per
sequence (B,); `python -m vrl.experiments.analyze` averages them over validation sequences.

- entropy: attention averaged over heads; the importance of key j is the sum over queries of
  A_ij, normalised to 1; its natural-log entropy. Lower = more concentrated (eq. 11).
- first_token_attention: attention mass on the first token, averaged over heads and queries.
- similarity: mean off-diagonal cosine similarity of a sequence's token states (eq. 13).
- value / hidden norms: L2 norm of the first token's attended values (over kv heads and head
  dims) or hidden state, and the mean of the other tokens' ("value-state drains").
- value_gate: a value embedding's gate 2 sigmoid(x W) averaged over tokens and kv heads (1 at
  init: the lookup added as is; towards 0: shut); NaN in a layer without a value embedding.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from vrl.model import ops

Array = jax.Array


class AttentionStats(NamedTuple):
    entropy: Array
    first_token_attention: Array
    value_norm_first: Array
    value_norm_rest: Array
    value_gate: Array


class LayerStats(NamedTuple):
    """One layer's statistics (B,) each, or (layers, B) for a whole model."""

    entropy: Array
    first_token_attention: Array
    value_norm_first: Array
    value_norm_rest: Array
    value_gate: Array
    hidden_norm_first: Array
    hidden_norm_rest: Array
    similarity: Array


def attention_probs(q_BxLxHxDh: Array, k_BxSxKxDh: Array, mask_BxLxS: Array, logits_cap: float) -> Array:
    """Softmax attention (float32; the logits soft-capped at `logits_cap`, 0: not capped) averaged
    over the H query heads: (B, L, S)."""
    B, L, H, Dh = q_BxLxHxDh.shape
    K = k_BxSxKxDh.shape[2]
    q_BxLxKxGxDh = q_BxLxHxDh.reshape(B, L, K, H // K, Dh).astype(jnp.float32)
    logits_BxKxGxLxS = jnp.einsum('blkgd,bskd->bkgls', q_BxLxKxGxDh, k_BxSxKxDh.astype(jnp.float32)) / math.sqrt(Dh)
    logits_BxKxGxLxS = jnp.where(mask_BxLxS[:, None, None], ops.soft_cap(logits_BxKxGxLxS, logits_cap), -jnp.inf)
    return jnp.mean(jax.nn.softmax(logits_BxKxGxLxS, axis=-1), axis=(1, 2))


def attention_entropy(probs_BxLxS: Array) -> Array:
    """Entropy (nats) of key importance: column sums of the attention, normalised to 1."""
    importance_BxS = jnp.sum(probs_BxLxS, axis=1)
    importance_BxS = importance_BxS / jnp.sum(importance_BxS, axis=-1, keepdims=True)
    return -jnp.sum(jax.scipy.special.xlogy(importance_BxS, importance_BxS), axis=-1)


def first_token_attention(probs_BxLxS: Array) -> Array:
    return jnp.mean(probs_BxLxS[:, :, 0], axis=-1)


def token_similarity(h_BxLxD: Array) -> Array:
    """Mean cosine similarity over all pairs of distinct tokens of each sequence."""
    h = h_BxLxD.astype(jnp.float32)
    unit_BxLxD = h / jnp.maximum(jnp.linalg.norm(h, axis=-1, keepdims=True), 1e-30)
    cosines_BxLxL = jnp.einsum('bid,bjd->bij', unit_BxLxD, unit_BxLxD)
    L = h.shape[1]
    off_diagonal = jnp.sum(cosines_BxLxL, axis=(1, 2)) - jnp.trace(cosines_BxLxL, axis1=1, axis2=2)
    return off_diagonal / (L * (L - 1))


def first_and_rest_norms(x_BxLx___: Array) -> tuple[Array, Array]:
    """(norm of token 0, mean norm of tokens 1..L-1), each (B,); norms over all trailing dims."""
    x = x_BxLx___.astype(jnp.float32)
    norms_BxL = jnp.sqrt(jnp.sum(x.reshape(*x.shape[:2], -1) ** 2, axis=-1))
    return norms_BxL[:, 0], jnp.mean(norms_BxL[:, 1:], axis=-1)


def attention_stats(
    q_BxLxHxDh: Array,
    k_BxSxKxDh: Array,
    v_BxSxKxDh: Array,
    mask_BxLxS: Array,
    value_gate_BxLxKx1: Array | None,
    logits_cap: float,
) -> AttentionStats:
    """The attention statistics; value_gate_BxLxKx1 is the layer's value-embedding gate (None: none),
    `logits_cap` the model's attention soft cap (0: none)."""
    probs_BxLxS = attention_probs(q_BxLxHxDh, k_BxSxKxDh, mask_BxLxS, logits_cap)
    B = q_BxLxHxDh.shape[0]
    gate_B = (
        jnp.full((B,), jnp.nan, jnp.float32)
        if value_gate_BxLxKx1 is None
        else jnp.mean(value_gate_BxLxKx1.astype(jnp.float32), axis=(1, 2, 3))
    )
    return AttentionStats(
        attention_entropy(probs_BxLxS), first_token_attention(probs_BxLxS), *first_and_rest_norms(v_BxSxKxDh), gate_B
    )


def layer_stats(attention: AttentionStats, h_BxLxD: Array) -> LayerStats:
    """The layer's attention statistics with those of its output hidden state."""
    return LayerStats(*attention, *first_and_rest_norms(h_BxLxD), token_similarity(h_BxLxD))


def first_layer(statistic: str) -> int:
    """The layer of a per-layer record's first value: similarity starts at the embedding output (0),
    ResFormer's lambdas (`lambda_1`, `lambda_2`) at layer 2, every other statistic at layer 1."""
    return {'similarity': 0, 'lambda_1': 2, 'lambda_2': 2}.get(statistic, 1)


def by_layer(statistic: str, values: list[float | None]) -> dict[str, float]:
    """A per-layer record as {"layer_<i>": value}, leaving out the layers without one (None)."""
    return {f'layer_{i}': v for i, v in enumerate(values, first_layer(statistic)) if v is not None}
