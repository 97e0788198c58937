"""Attention concentration and the states behind it, per layer (docs/paper.md, 'How the paper measures concentration').

Pure functions of one layer's arrays. Each Block sows what its queries attended (`Attended`, an
`nnx.Intermediate`); while `recording()` (which `Decoder.layer_stats` opens) `Decoder._layer`
captures it and turns it into the layer's statistics at once, so only one layer's (L x S)
attention maps exist at a time; otherwise nothing is kept. Each statistic is one float per
sequence (B,); `python -m vrl.experiments.analyze` averages them over validation sequences.

- entropy: attention averaged over heads; the importance of key j is the sum over queries of
  A_ij, normalised to 1; its natural-log entropy. Lower = more concentrated (eq. 11).
- first_token_attention: attention mass on the first token, averaged over heads and queries.
- similarity: mean off-diagonal cosine similarity of a sequence's token states (eq. 13).
- value / hidden norms: L2 norm of the first token's attended values (over kv heads and head
  dims) or hidden state, and the mean of the other tokens' ("value-state drains"). The hidden
  state is the layer's output stream (hyper-connections: the streams' sum; attention residuals:
  the embedding plus every sublayer output so far, the plain residual they stand for).
- value_gate: a value embedding's gate 2 sigmoid(x W) averaged over tokens and kv heads (1 at
  init: the lookup added as is; towards 0: shut); NaN in a layer without a value embedding.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from vrl.model import ops

Array = jax.Array

# Whether the forward being traced records statistics; a trace-time setting, like the mesh.
_RECORDING = contextvars.ContextVar('vrl_layer_stats_recording', default=False)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Within it, each layer traced hands on its statistics (`captured`)."""
    token = _RECORDING.set(True)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def is_recording() -> bool:
    return _RECORDING.get()


class Attended(NamedTuple):
    """What a layer's queries attended, as its Block sows it."""

    q_BxLxHxDh: Array
    keys_BxSxKxDh: Array
    values_BxSxKxDh: Array
    mask: Any  # attention.Causal over the L tokens, or decoding's (B, L, S) boolean mask
    value_gate_BxLxKx1: Array | None  # the layer's value-embedding gate (None: none)
    logits_cap: float  # the model's attention soft cap (0: none)


def captured(block: nnx.Module, *args: Any) -> tuple[Any, Attended | None]:
    """block(*args), and what it sowed as 'attended' while `recording()` (None otherwise: its sow
    keeps nothing). The block runs as a copy made in the trace at hand, which its sow may mutate
    (a module from an outer trace, which jax.jit closes over, may not be)."""
    block = nnx.merge(*nnx.split(block))
    if not is_recording():
        return nnx.capture(block)(*args), None
    out, sown = nnx.capture(block, nnx.Intermediate)(*args)
    (attended,) = sown['attended'].get_value()
    return out, attended


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


def attention_stats(a: Attended) -> AttentionStats:
    """The statistics of what a layer's queries attended."""
    B, L = a.q_BxLxHxDh.shape[:2]
    mask_BxLxS = a.mask if isinstance(a.mask, jax.Array) else a.mask.dense(B, L)
    dtype = a.q_BxLxHxDh.dtype
    probs_BxLxS = attention_probs(a.q_BxLxHxDh, a.keys_BxSxKxDh.astype(dtype), mask_BxLxS, a.logits_cap)
    gate_B = (
        jnp.full((B,), jnp.nan, jnp.float32)
        if a.value_gate_BxLxKx1 is None
        else jnp.mean(a.value_gate_BxLxKx1.astype(jnp.float32), axis=(1, 2, 3))
    )
    values_BxSxKxDh = a.values_BxSxKxDh.astype(dtype)
    return AttentionStats(
        attention_entropy(probs_BxLxS),
        first_token_attention(probs_BxLxS),
        *first_and_rest_norms(values_BxSxKxDh),
        gate_B,
    )


def layer_stats(attended: Attended, h_BxLxD: Array) -> LayerStats:
    """The layer's attention statistics with those of its output hidden state."""
    return LayerStats(*attention_stats(attended), *first_and_rest_norms(h_BxLxD), token_similarity(h_BxLxD))


def first_layer(statistic: str) -> int:
    """The layer of a per-layer record's first value: similarity starts at the embedding output (0),
    ResFormer's lambdas (`lambda_1`, `lambda_2`) at layer 2, every other statistic at layer 1."""
    return {'similarity': 0, 'lambda_1': 2, 'lambda_2': 2}.get(statistic, 1)


def by_layer(statistic: str, values: list[float | None]) -> dict[str, float]:
    """A per-layer record as {"layer_<i>": value}, leaving out the layers without one (None)."""
    return {f'layer_{i}': v for i, v in enumerate(values, first_layer(statistic)) if v is not None}
