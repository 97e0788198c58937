"""MUDD, multiway dynamic dense connections (Xiao et al., arXiv 2502.12170; model.residual='mudd'):
a dynamic DenseFormer whose next block's inputs are each their own mix.

After a layer, each way named in model.mudd_ways (q, k, v: the next attention's query, key and value
inputs; r: its residual) is a mix of the embedding output and every block output so far, weighted
per position by a small MLP of the newest output plus static weights (`DenseConnections`). The
history is DenseFormer's (vrl/model/residual/dense.py); the r way is the stream, the others reach
the next attention through `attention_inputs`, each normalised by its own pre-norm.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis
from vrl.model import ops, params
from vrl.model.norms import RMSNorm
from vrl.model.residual.base import History
from vrl.model.residual.dense import DenseFormer, appended, weighted_sum

Array = jax.Array


class MuddWeights(NamedTuple):
    """The MUDD connection after a layer, padded to the widest (zeros past its own), or those after
    several layers (a leading axis). After a layer without one: zero weights and a static one-hot on
    the newest output."""

    w_in: Array  # (D, Hmax): RMSNorm(newest output) -> the hidden layer (GELU)
    w_out: Array  # (Hmax, C, L + 1): the hidden layer -> per-position weights of each way over B_0..B_L
    static: Array  # (C, L + 1): added to them


class DenseConnections(nnx.Module):
    """MUDD: after 0-based layer i (cfg.mudd_after(i) non-empty), each way c of the C = len(cfg.mudd_ways)
    ways of the next block's input (the last way, r, its residual) is sum_j w_cj B_j over the embedding
    output B_0 and the block outputs B_1..B_{i+1}, with per-position weights

        w_cj = (GELU(RMSNorm(B_{i+1}) W_in) W_out)_cj + static_cj   (RMSNorm without a scale).

    Parameters per connection, in the authors' shapes: W_in (D, H_i), W_out (H_i, C_i (i + 2)) and
    static (C_i, i + 2), C_i = 1 after the last layer (H_i: cfg.mudd_hidden). W_in ~ N(0, 1 / D) and
    W_out = 0 as the authors initialise them, static one-hot on the newest output: vanilla at the start."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        L, D, ways = cfg.n_layers, cfg.d_model, cfg.mudd_ways
        self.connected = tuple(i for i in range(L) if cfg.mudd_after(i))  # static
        self.ways = ways
        self.shapes = tuple((cfg.mudd_after(i), cfg.mudd_hidden(i)) for i in self.connected)  # static
        self.w_in = nnx.List(
            [params.normal(rngs, (D, hidden), (Axis.EMBED, None), D**-0.5) for _, hidden in self.shapes]
        )
        self.w_out = nnx.List(
            [
                params.constant(np.zeros((hidden, len(w) * (i + 2))), (None, None))
                for i, (w, hidden) in zip(self.connected, self.shapes)
            ]
        )
        self.static = nnx.List(
            [params.constant(_newest(len(w), i + 2), (None, None)) for i, (w, _) in zip(self.connected, self.shapes)]
        )
        self.n_layers, self.hidden = L, max(hidden for _, hidden in self.shapes)

    def for_layers(self) -> MuddWeights:
        """(L, ...) weights of the connection after each layer, padded: way r last, an r-only connection's
        one way put there."""
        L, C, H = self.n_layers, len(self.ways), self.hidden
        D = self.w_in[0].shape[0]
        w_in, w_out = jnp.zeros((L, D, H), jnp.float32), jnp.zeros((L, H, C, L + 1), jnp.float32)
        static = jnp.asarray(np.stack([np.pad(_newest(C, i + 2), ((0, 0), (0, L - 1 - i))) for i in range(L)]))
        for n, (i, (ways, hidden)) in enumerate(zip(self.connected, self.shapes)):
            at = slice(C - len(ways), C)  # an r-only connection is way r
            w_in = w_in.at[i, :, :hidden].set(self.w_in[n][...])
            w_out = w_out.at[i, :hidden, at, : i + 2].set(self.w_out[n][...].reshape(hidden, len(ways), i + 2))
            static = static.at[i, at, : i + 2].set(self.static[n][...])
        return MuddWeights(w_in, w_out, static)


def mudd_mixes(newest_BxLxD: Array, blocks: Array | tuple[Array, ...], w: MuddWeights, eps: float) -> Array:
    """(C, B, L, D): each way's mix of the outputs so far (`weighted_sum`'s buffer or tuple), weighted
    per position by GELU(RMSNorm(newest) W_in) W_out + static, computed in float32 (exact GELU, as the
    authors' PyTorch; their JAX uses the tanh approximation)."""
    x = ops.rms_normalized(newest_BxLxD, eps)
    hidden_BxLxH = jax.nn.gelu(x @ w.w_in, approximate=False)
    weights_BxLxCxJ = jnp.einsum('blh,hcj->blcj', hidden_BxLxH, w.w_out) + w.static[None, None]
    return jnp.stack([weighted_sum(weights_BxLxCxJ[:, :, c], blocks) for c in range(weights_BxLxCxJ.shape[2])])


def _newest(ways: int, inputs: int) -> np.ndarray:
    """(ways, inputs): each way all on the newest input (the block output just made)."""
    return np.eye(inputs, dtype=np.float32)[-1:].repeat(ways, 0)


class Mudd(DenseFormer):
    """DenseFormer's history, mixed after each layer per way and per position."""

    def model_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        return {'mudd': DenseConnections(self.cfg, rngs)}

    def block_params(self, *, first: bool, stack: int | None, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        mixed = '' if first else self.cfg.mudd_ways[:-1]
        return {f'{way}_input_norm': RMSNorm(self.cfg, stack) for way in 'kv' if way in mixed}

    def per_layer(self, model: nnx.Module) -> MuddWeights:
        return model.mudd.for_layers()

    def attention_inputs(
        self, block: nnx.Module, h: Array, history: History, inputs: Array | None, layer: int | Array
    ) -> tuple[Array, Array, Array, Any]:
        mixed = {} if inputs is None else dict(zip(self.cfg.mudd_ways[:-1], inputs))
        x_BxLxD = block.attn_norm(mixed.get('q', h))
        xk_BxLxD = block.k_input_norm(mixed['k']) if 'k' in mixed else x_BxLxD
        xv_BxLxD = block.v_input_norm(mixed['v']) if 'v' in mixed else x_BxLxD
        return x_BxLxD, xk_BxLxD, xv_BxLxD, None

    def after_layer(
        self, model: nnx.Module, h: Array, history: History, weights: MuddWeights, layer: int | Array
    ) -> tuple[Array, History, Array | None]:
        history = appended(history, h, layer)
        mixes_CxBxLxD = mudd_mixes(h, history, weights, self.cfg.norm_eps)  # r last
        return mixes_CxBxLxD[-1], history, mixes_CxBxLxD[:-1] if len(self.cfg.mudd_ways) > 1 else None

    def _connections(self) -> list[tuple[int, int]]:
        """(inputs x ways, hidden width) of each connection: after 0-based layer i, (i + 2) len(ways)."""
        cfg = self.cfg
        return [
            ((i + 2) * len(cfg.mudd_after(i)), cfg.mudd_hidden(i)) for i in range(cfg.n_layers) if cfg.mudd_after(i)
        ]

    def matmul_params(self) -> int:
        return sum(hidden * (self.cfg.d_model + weights) for weights, hidden in self._connections())  # W_in, W_out

    def mix_macs(self) -> int:
        return sum(weights for weights, _ in self._connections()) * self.cfg.d_model  # each way's weighted sum

    def history_vectors(self) -> int:
        return self.cfg.n_layers + 1 + len(self.cfg.mudd_ways) - 1  # B_0..B_L and the q, k, v ways
