"""Attention Residuals (Kimi team, arXiv 2603.15031; model.attn_residuals): the residual stream's fixed
sum replaced by a softmax attention over depth.

Each sublayer (every layer's attention and its MLP) reads, instead of the running sum, a mix of the
sources before it: the embedding output and what the sublayers before it added,

    input = sum_j alpha_j v_j,   alpha = softmax_j(w . RMSNorm(v_j)),

with its own pseudo-query w (D,) and key-norm scale (D,). 'full': every sublayer's output is a source
of its own (2 L + 1 sources in all). 'block' (Block AttnRes): the layers split into
model.attn_residual_blocks blocks; a block's sublayer outputs are summed as they come (the partial sum,
itself a source while its block runs) and the sum becomes one source when the block ends (N + 1 sources).
After the last layer one more query mixes every source into the final norm's input.

The stream between sublayers is the partial sum h (B, L, D), zero where none has begun, and the
completed sources, a buffer (S, B, L, D) zero past those written (unrolled layers: a tuple). The
queries start at zero: each sublayer's input is the mean of its sources, which its pre-norm (and the
final norm) turn into the plain residual's input up to the norms' eps, so the model starts as vanilla.

Where the authors' pseudocode leaves a choice, vrl reads it so: a layer is two sublayers, each with
its own query (their block size counts both); the key norm has a learned scale, as an RMSNorm module
does; and an output query mixes the sources after the last layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis
from vrl.model import ops, params
from vrl.model.config import ModelConfig

Array = jax.Array


def n_sources(cfg: ModelConfig) -> int:
    """The completed sources a forward ends with: 2 L + 1 ('full') or N + 1 ('block')."""
    return 2 * cfg.n_layers + 1 if cfg.attn_residuals == 'full' else cfg.attn_residual_blocks + 1


def seen(cfg: ModelConfig, layer: int | Array, sublayer: int) -> tuple[int | Array, bool | Array]:
    """Before 0-based `layer`'s attention (`sublayer` 0) or MLP (1): how many completed sources there are
    (the next one is written at that index), and whether a partial sum is among the sources."""
    if cfg.attn_residuals == 'full':
        return 1 + 2 * layer + sublayer, False
    per_block = cfg.attn_residual_layers
    return 1 + layer // per_block, (sublayer == 1) | (layer % per_block != 0)


def completes(cfg: ModelConfig, layer: int | Array, sublayer: int) -> bool | Array:
    """Whether the partial sum becomes a source after this sublayer: every one ('full'), or a block's last MLP."""
    if cfg.attn_residuals == 'full':
        return True
    return (sublayer == 1) & ((layer + 1) % cfg.attn_residual_layers == 0)


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
        self, h_BxLxD: Array, sources: Array | tuple[Array, ...], count: int | Array, partial: bool | Array
    ) -> Array:
        """The mix (B, L, D) of the first `count` completed sources and, where `partial`, the partial sum h."""
        sources_SxBxLxD = jnp.stack(sources) if isinstance(sources, tuple) else sources  # unrolled: all seen
        w_D = (self.query[...] * self.key_scale[...]).astype(jnp.float32)  # w . (g * x / rms(x))
        logit = lambda v: ops.rms_normalized(v, self.eps) @ w_D  # noqa: E731
        written_S = jnp.arange(sources_SxBxLxD.shape[0]) < count
        logits_SxBxL = jnp.where(written_S[:, None, None], logit(sources_SxBxLxD), -jnp.inf)
        partial_BxL = jnp.where(partial, logit(h_BxLxD), -jnp.inf)
        weights_SxBxL = jax.nn.softmax(jnp.concatenate([logits_SxBxL, partial_BxL[None]]), axis=0)
        mixed = jnp.einsum('sbl,sbld->bld', weights_SxBxL[:-1].astype(sources_SxBxLxD.dtype), sources_SxBxLxD)
        return (mixed + weights_SxBxL[-1, ..., None].astype(h_BxLxD.dtype) * h_BxLxD).astype(h_BxLxD.dtype)


def settle(
    h_BxLxD: Array, sources: Array | tuple[Array, ...], index: int | Array, done: bool | Array
) -> tuple[Array, Array | tuple[Array, ...]]:
    """After a sublayer (its output added to h): where `done`, h becomes source `index` and the partial
    sum starts again at zero. A buffer's entry `index` is unwritten otherwise, so zero is written there."""
    if isinstance(sources, tuple):  # unrolled: `done` is known
        return (jnp.zeros_like(h_BxLxD), (*sources, h_BxLxD)) if done else (h_BxLxD, sources)
    written = jnp.where(done, h_BxLxD, jnp.zeros((), h_BxLxD.dtype)).astype(sources.dtype)
    sources = jax.lax.dynamic_update_index_in_dim(sources, written, index, 0)
    return jnp.where(done, jnp.zeros((), h_BxLxD.dtype), h_BxLxD), sources


def begin(embedded_BxLxD: Array, cfg: ModelConfig, scanned: bool) -> tuple[Array, Array | tuple[Array, ...]]:
    """The stream before layer 1: no partial sum, and the embedding output the first source (in a buffer
    of n_sources where the layers are scanned)."""
    if not scanned:
        return jnp.zeros_like(embedded_BxLxD), (embedded_BxLxD,)
    buffer = jnp.zeros((n_sources(cfg), *embedded_BxLxD.shape), embedded_BxLxD.dtype).at[0].set(embedded_BxLxD)
    return jnp.zeros_like(embedded_BxLxD), buffer
