"""Attention Residuals (Kimi team, arXiv 2603.15031; model.residual='attnres'): the residual stream's fixed
sum replaced by a softmax attention over depth.

Each sublayer (every layer's attention and its MLP) reads, instead of the running sum, a mix of the
sources before it: the embedding output and what the sublayers before it added,

    input = sum_j alpha_j v_j,   alpha = softmax_j(w . RMSNorm(v_j)),

with its own pseudo-query w (D,) and key-norm scale (D,). Full (model.attn_residual_blocks=0): every
sublayer's output is a source of its own (2 L + 1 sources in all). Block AttnRes (attn_residual_blocks=N):
the layers split into N blocks; a block's sublayer outputs are summed as they come (the partial sum, itself
a source while its block runs) and the sum becomes one source when the block ends (N + 1 sources).
After the last layer one more query mixes every source into the final norm's input.

The stream between sublayers is the partial sum h (B, L, D), zero where none has begun, and the
completed sources. In full AttnRes an attention's output is its MLP's partial sum, and both outputs
become sources after the MLP, so that a layer's two queries read the same completed sources (the
same softmax as writing the attention's first; the layer scan then keeps no copy of the buffer per
layer: vrl/model/history_scan.py). The completed sources are, where the layers are scanned, a `Buffer`
(S, B, L, D) zero past those written, with each source's 1 / RMS computed once, when it is written, and
a query's partial sum merged with the buffer's mix through its logsumexp; unrolled layers (decoding) hand
on a tuple, which a query stacks with the partial sum for one softmax (fewer ops per token). The queries
start at zero: each sublayer's input is the mean of its sources, which its pre-norm (and the final norm)
turn into the plain residual's input up to the norms' eps, so the model starts as vanilla.

Where the authors' pseudocode leaves a choice, vrl reads it so: a layer is two sublayers, each with
its own query (their block size counts both); the key norm has a learned scale, as an RMSNorm module
does; and an output query mixes the sources after the last layer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis
from vrl.model import ops, params
from vrl.model.config import ModelConfig
from vrl.model.residual.base import Plain

Array = jax.Array

SUBLAYERS = ('attn_depth', 'mlp_depth')  # each block's queries, attention's and MLP's


class Buffer(NamedTuple):
    """The completed sources of scanned layers: values (S, B, L, D) in the compute dtype, zero past those
    written, and each one's 1 / sqrt(mean(v^2) + eps) (S, B, L), float32."""

    values: Array
    inv_rms: Array


def _inv_rms(v: Array, eps: float) -> Array:
    """1 / RMS over the last axis, float32: (..., D) -> (...)."""
    v = v.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)


def n_sources(cfg: ModelConfig) -> int:
    """The completed sources a forward ends with: 2 L + 1 (full) or N + 1 (block)."""
    return 2 * cfg.n_layers + 1 if not cfg.attn_residual_blocks else cfg.attn_residual_blocks + 1


def seen(cfg: ModelConfig, layer: int | Array, sublayer: int) -> tuple[int | Array, bool | Array]:
    """Before 0-based `layer`'s attention (`sublayer` 0) or MLP (1): how many completed sources there are
    (the next one is written at that index), and whether a partial sum is among the sources."""
    if not cfg.attn_residual_blocks:  # the MLP's partial sum is its attention's output
        return 1 + 2 * layer, sublayer == 1
    per_block = cfg.attn_residual_layers  # the partial sum known when tracing wherever it can be
    return 1 + layer // per_block, sublayer == 1 or (per_block > 1 and layer % per_block != 0)


def completes(cfg: ModelConfig, layer: int | Array, sublayer: int) -> bool | Array:
    """Whether the partial sum becomes a source after this sublayer: after every MLP (full: the attention's
    output and the MLP's, two sources), or a block's last MLP."""
    if not cfg.attn_residual_blocks:
        return sublayer == 1
    per_block = cfg.attn_residual_layers  # known when tracing wherever it can be: never after an attention
    return sublayer == 1 and (per_block == 1 or (layer + 1) % per_block == 0)


def sources_per_sublayer(cfg: ModelConfig) -> list[int]:
    """How many sources each sublayer's query weighs, in order, then the output query's."""
    counts = []
    for layer in range(cfg.n_layers):
        for sublayer in (0, 1):
            count, partial = seen(cfg, layer, sublayer)
            counts.append(int(count) + bool(partial))
    return [*counts, n_sources(cfg)]


class DepthQuery(nnx.Module):
    """One sublayer's query over depth (`stack`: one per stacked layer): w (D,), zero at init, and the
    key norm's scale (D,), one at init."""

    def __init__(self, cfg: ModelConfig, stack: int | None):
        self.query = params.constant(np.zeros(cfg.d_model), (Axis.EMBED,), stack)
        self.key_scale = params.constant(np.ones(cfg.d_model), (Axis.EMBED,), stack)
        self.eps = cfg.norm_eps

    def __call__(
        self, h_BxLxD: Array, sources: Buffer | tuple[Array, ...], count: int | Array, partial: bool | Array
    ) -> Array:
        """The mix (B, L, D) of the first `count` completed sources and, where `partial`, the partial sum h."""
        w_D = (self.query[...] * self.key_scale[...]).astype(jnp.float32)  # w . (g * v / rms(v))
        if not isinstance(sources, Buffer):  # unrolled: every source seen, and the partial sum one more
            sources_SxBxLxD = jnp.stack((*sources, h_BxLxD) if partial else sources)
            every_S = jnp.ones(sources_SxBxLxD.shape[:1], bool)
            mixed_BxLxD, _ = depth_mix(sources_SxBxLxD, _inv_rms(sources_SxBxLxD, self.eps), w_D, every_S)
            return mixed_BxLxD.astype(h_BxLxD.dtype)
        sources_SxBxLxD, inv_rms_SxBxL = sources
        written_S = jnp.arange(sources_SxBxLxD.shape[0]) < count
        mixed_BxLxD, lse_BxL = depth_mix(sources_SxBxLxD, inv_rms_SxBxL, w_D, written_S)
        if partial is False:  # known when tracing (full's attentions, a block's first, the output query)
            return mixed_BxLxD.astype(h_BxLxD.dtype)
        # the partial sum merged as one more source: its softmax weight against the sources' logsumexp
        partial_BxL = ops.dot_last(h_BxLxD, w_D[None, None]) * _inv_rms(h_BxLxD, self.eps)
        kept_BxLx1 = jnp.where(partial, jax.nn.sigmoid(lse_BxL - partial_BxL), 1.0)[..., None]
        return (kept_BxLx1 * mixed_BxLxD + (1 - kept_BxLx1) * h_BxLxD.astype(jnp.float32)).astype(h_BxLxD.dtype)


@jax.custom_vjp
def depth_mix(sources_SxBxLxD: Array, inv_rms_SxBxL: Array, w_D: Array, written_S: Array) -> tuple[Array, Array]:
    """sum_s alpha_s v_s (B, L, D) and logsumexp_s of the logits (B, L), float32, over the written sources,
    alpha = softmax_s(w . v_s / rms(v_s)).

    Written by hand, with its backward, so that each pass over the S sources is one elementwise loop:
    einsums over the source axis transpose the whole buffer, in the forward and again in the backward
    (docs/performance.md, "Attention Residuals' step")."""
    return _depth_mix_forward(sources_SxBxLxD, inv_rms_SxBxL, w_D, written_S)[0]


def _depth_mix_forward(sources_SxBxLxD, inv_rms_SxBxL, w_D, written_S):
    dots_SxBxL = ops.dot_last(sources_SxBxLxD, w_D[None, None, None])
    logits_SxBxL = jnp.where(written_S[:, None, None], dots_SxBxL * inv_rms_SxBxL, -jnp.inf)
    lse_BxL = jax.nn.logsumexp(logits_SxBxL, axis=0)
    alpha_SxBxL = jnp.exp(logits_SxBxL - lse_BxL[None])
    mixed_BxLxD = ops.mix_rows(alpha_SxBxL, sources_SxBxLxD)
    return (mixed_BxLxD, lse_BxL), (sources_SxBxLxD, inv_rms_SxBxL, w_D, alpha_SxBxL, dots_SxBxL)


def _depth_mix_backward(residuals, cotangents):
    """With g the mix's cotangent: d alpha_s = <g, v_s>; d logit_s = alpha_s (d alpha_s - sum_t alpha_t
    d alpha_t + d lse); d v_s = alpha_s g + d logit_s w / rms(v_s); d (1 / rms(v_s)) = d logit_s (w . v_s);
    d w = sum_s d logit_s v_s / rms(v_s), summed over the tokens."""
    sources_SxBxLxD, inv_rms_SxBxL, w_D, alpha_SxBxL, dots_SxBxL = residuals
    d_mixed_BxLxD, d_lse_BxL = cotangents
    d_alpha_SxBxL = ops.dot_last(sources_SxBxLxD, d_mixed_BxLxD[None])
    d_logits_SxBxL = alpha_SxBxL * (
        d_alpha_SxBxL - jnp.sum(alpha_SxBxL * d_alpha_SxBxL, axis=0, keepdims=True) + d_lse_BxL[None]
    )
    scaled_SxBxL = d_logits_SxBxL * inv_rms_SxBxL
    d_sources = alpha_SxBxL[..., None] * d_mixed_BxLxD[None] + scaled_SxBxL[..., None] * w_D[None, None, None]
    d_w_D = jnp.sum(scaled_SxBxL[..., None] * sources_SxBxLxD.astype(jnp.float32), axis=(0, 1, 2))
    d_inv_rms_SxBxL = d_logits_SxBxL * dots_SxBxL
    return d_sources.astype(sources_SxBxLxD.dtype), d_inv_rms_SxBxL, d_w_D, None


depth_mix.defvjp(_depth_mix_forward, _depth_mix_backward)


def settle(
    h_BxLxD: Array,
    completed: tuple[Array, ...],
    sources: Buffer | tuple[Array, ...],
    index: int | Array,
    done: bool | Array,
    eps: float,
) -> tuple[Array, Buffer | tuple[Array, ...]]:
    """After a sublayer (its output added to h): where `done`, the `completed` sources (each (B, L, D))
    become sources `index`, `index` + 1, ... and the partial sum starts again at zero. A buffer's entries
    there are unwritten otherwise, so zeros are written there."""
    if not isinstance(sources, Buffer):  # unrolled: `done` is known
        return (jnp.zeros_like(h_BxLxD), (*sources, *completed)) if done else (h_BxLxD, sources)
    if done is False:  # known when tracing (every attention): the buffer as it was, one array for both mixes
        return h_BxLxD, sources
    zero = jnp.zeros((), h_BxLxD.dtype)
    written = (
        jnp.stack([jnp.where(done, c, zero) for c in completed]).astype(sources.values.dtype),
        jnp.stack([jnp.where(done, _inv_rms(c, eps), 0.0) for c in completed]),
    )
    sources = Buffer(*(jax.lax.dynamic_update_slice_in_dim(b, w, index, 0) for b, w in zip(sources, written)))
    return jnp.where(done, zero, h_BxLxD), sources


def residual_sum(h_BxLxD: Array, sources: Buffer | tuple[Array, ...]) -> Array:
    """The plain residual stream this one stands for: the embedding output plus every sublayer output so
    far, the sources' and the partial sum's total (B, L, D) (the statistics' hidden state)."""
    values = sources.values if isinstance(sources, Buffer) else jnp.stack(sources)
    return (jnp.sum(values, axis=0) + h_BxLxD).astype(h_BxLxD.dtype)


def begin(embedded_BxLxD: Array, cfg: ModelConfig, scanned: bool) -> tuple[Array, Buffer | tuple[Array, ...]]:
    """The stream before layer 1: no partial sum, and the embedding output the first source (in a buffer
    of n_sources where the layers are scanned)."""
    if not scanned:
        return jnp.zeros_like(embedded_BxLxD), (embedded_BxLxD,)
    S = n_sources(cfg)
    values = jnp.zeros((S, *embedded_BxLxD.shape), embedded_BxLxD.dtype).at[0].set(embedded_BxLxD)
    inv_rms = jnp.zeros((S, *embedded_BxLxD.shape[:2]), jnp.float32).at[0].set(_inv_rms(embedded_BxLxD, cfg.norm_eps))
    return jnp.zeros_like(embedded_BxLxD), Buffer(values, inv_rms)


class AttnRes(Plain):
    """Each sublayer's input a softmax over the sources before it; the history is the completed sources."""

    def model_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        return {'depth_output': DepthQuery(self.cfg, None)}

    def block_params(self, *, first: bool, stack: int | None, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        return {name: DepthQuery(self.cfg, stack) for name in SUBLAYERS}

    def begin(self, model: nnx.Module, embedded_BxLxD: Array, scanned: bool) -> tuple[Array, Buffer | tuple]:
        return begin(embedded_BxLxD, self.cfg, scanned)

    def sublayer_input(
        self, block: nnx.Module, h: Array, history: Buffer | tuple, layer: int | Array, sublayer: int
    ) -> tuple[Array, None]:
        return getattr(block, SUBLAYERS[sublayer])(h, history, *seen(self.cfg, layer, sublayer)), None

    def add(
        self,
        block: nnx.Module,
        h: Array,
        history: Buffer | tuple,
        out_BxLxD: Array,
        adding: None,
        layer: int | Array,
        sublayer: int,
    ) -> tuple[Array, Buffer | tuple]:
        index, _ = seen(self.cfg, layer, sublayer)
        done = completes(self.cfg, layer, sublayer)
        # a block's sublayer outputs summed into one source; full's attention output and MLP output two
        completed = (h + out_BxLxD,) if self.cfg.attn_residual_blocks else (h, out_BxLxD)
        return settle(h + out_BxLxD, completed, history, index, done, self.cfg.norm_eps)

    def written(self, first_layers: list[int]) -> tuple[int, ...]:
        return tuple(seen(self.cfg, layer, 0)[0] for layer in first_layers)

    def hidden(self, h: Array, history: Buffer | tuple) -> Array:
        return residual_sum(h, history)

    def readout(self, model: nnx.Module, h: Array, history: Buffer | tuple) -> Array:
        return model.depth_output(h, history, n_sources(self.cfg), False)

    def mix_macs(self) -> int:
        """Each query's dot with every normalised source it weighs, and their weighted sum: D each per source."""
        return 2 * self.cfg.d_model * sum(sources_per_sublayer(self.cfg))

    def history_vectors(self) -> int:
        return n_sources(self.cfg)

    def constant_params(self) -> int:
        """Layer 1's first query and its key scale (D each) where they weigh one source, the embedding: a
        softmax over one source is 1 whatever they hold (docs/variants.md)."""
        return 2 * self.cfg.d_model if sources_per_sublayer(self.cfg)[0] == 1 else 0
