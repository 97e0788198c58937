"""DenseFormer (Pagliardini et al., arXiv 2402.02622; model.residual='dense'): after block i the next
block's input is a learned average of the embedding output B_0 and every block output B_1..B_i,

    h_i = sum_{j <= i} alpha_ij B_j,

with static weights, initialised to the identity (the newest output alone: vanilla). The history is the
outputs so far: a buffer (L + 1, B, L, D), zero past the newest, where the layers are scanned; a tuple
of (B, L, D) outputs, each held once, where they are not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.model import ops, params
from vrl.model.residual.base import History, Plain

Array = jax.Array


class DepthWeights(nnx.Module):
    """DenseFormer's depth-weighted averages: after block i (1..L) the next input is
    sum_{j <= i} alpha_ij B_j over the embedding output B_0 and the block outputs B_1..B_i.
    L (L + 3) / 2 weights, initialised to the identity (alpha_ii = 1, the rest 0): vanilla."""

    def __init__(self, cfg):
        L = self.n_layers = cfg.n_layers
        rows, cols = np.tril_indices(L, k=1, m=L + 1)  # row i is block i + 1
        self.rows, self.cols = tuple(rows.tolist()), tuple(cols.tolist())  # static
        self.alpha = params.constant(cols == rows + 1, (None,))

    def matrix(self) -> Array:
        """(L, L + 1): row i weighs B_0..B_{i+1}; the entries past the block are 0."""
        L = self.n_layers
        return jnp.zeros((L, L + 1), jnp.float32).at[np.asarray(self.rows), np.asarray(self.cols)].set(self.alpha[...])


def weighted_sum(weights: Array, blocks: Array | tuple[Array, ...]) -> Array:
    """sum_j weights[..., j] B_j over the outputs so far: a (J, B, L, D) buffer (weights (J,), or
    (B, L, J) per position), or a tuple of (B, L, D) outputs, each read where it lies (weights past
    the tuple's end are zero and skipped). A buffer is what the layer scan carries; unrolled layers
    hand on a tuple, which keeps each output once for the backward pass."""
    per_position = weights.ndim == 3
    if not isinstance(blocks, tuple):
        J, B, L, _ = blocks.shape
        return buffer_sum(weights if per_position else jnp.broadcast_to(weights, (B, L, J)), blocks)
    scale = (lambda j: weights[..., j, None]) if per_position else (lambda j: weights[j])
    return sum(scale(j).astype(b.dtype) * b for j, b in enumerate(blocks))


@jax.custom_vjp
def buffer_sum(weights_BxLxJ: Array, blocks_JxBxLxD: Array) -> Array:
    """sum_j weights[..., j] B_j (B, L, D) in the buffer's dtype, summed in float32.

    Written by hand, with its backward, so that each pass over the buffer is one elementwise loop: an
    einsum over the J axis transposes the whole buffer, in the forward and again in the backward (and
    the layer scan's backward rebuilds the buffer each layer: vrl/model/history_scan.py)."""
    return _buffer_sum_forward(weights_BxLxJ, blocks_JxBxLxD)[0]


def _buffer_sum_forward(weights_BxLxJ, blocks_JxBxLxD):
    mixed = ops.mix_rows(jnp.moveaxis(weights_BxLxJ, -1, 0), blocks_JxBxLxD)
    return mixed.astype(blocks_JxBxLxD.dtype), (weights_BxLxJ, blocks_JxBxLxD)


def _buffer_sum_backward(residuals, d_mixed_BxLxD):
    """d weights[..., j] = <g, B_j>; d B_j = weights[..., j] g."""
    weights_BxLxJ, blocks_JxBxLxD = residuals
    d_weights_JxBxL = ops.dot_last(blocks_JxBxLxD, d_mixed_BxLxD[None].astype(jnp.float32))
    w_JxBxLx1 = jnp.moveaxis(weights_BxLxJ, -1, 0)[..., None].astype(jnp.float32)
    d_blocks = w_JxBxLx1 * d_mixed_BxLxD[None].astype(jnp.float32)
    return jnp.moveaxis(d_weights_JxBxL, 0, -1).astype(weights_BxLxJ.dtype), d_blocks.astype(blocks_JxBxLxD.dtype)


buffer_sum.defvjp(_buffer_sum_forward, _buffer_sum_backward)


def appended(history: Array | tuple[Array, ...], out_BxLxD: Array, layer: int | Array) -> Array | tuple[Array, ...]:
    """The outputs so far with 0-based `layer`'s output B_{layer + 1} written."""
    if isinstance(history, tuple):
        return (*history, out_BxLxD)
    return jax.lax.dynamic_update_index_in_dim(history, out_BxLxD, layer + 1, 0)


class DenseFormer(Plain):
    """Each block's input a static average of the outputs so far; the blocks add to it as usual."""

    def model_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        return {'depth_weights': DepthWeights(self.cfg)}

    def per_layer(self, model: nnx.Module) -> Array:
        return model.depth_weights.matrix()  # (L, L + 1): row i after layer i

    def begin(self, model: nnx.Module, embedded_BxLxD: Array, scanned: bool) -> tuple[Array, History]:
        if not scanned:
            return embedded_BxLxD, (embedded_BxLxD,)
        L = self.cfg.n_layers
        return embedded_BxLxD, jnp.zeros((L + 1, *embedded_BxLxD.shape), embedded_BxLxD.dtype).at[0].set(embedded_BxLxD)

    def after_layer(
        self, model: nnx.Module, h: Array, history: History, row: Array, layer: int | Array
    ) -> tuple[Array, History, Array | None]:
        history = appended(history, h, layer)
        return weighted_sum(row, history), history, None

    def written(self, first_layers: list[int]) -> tuple[int, ...]:
        return tuple(layer + 1 for layer in first_layers)  # B_0..B_layer

    def history_vectors(self) -> int:
        return self.cfg.n_layers + 1  # B_0..B_L (its one average per layer is elementwise: no mix_macs)
