"""The parameters of the value-residual family and of the paper's baselines, per layer.

Each module here turns its own parameters into per-layer inputs for vrl/model/decoder.py's blocks:
a leading axis of N = n_layers - 1 entries for the stacked layers 2..L, which the layer scan
slices (`for_stack`), and, where layer 1 takes part, its entry alone (`for_first`). Where only
some layers have a parameter (CLA's key/value owners, value-embedding layers), the others get
zeros and a flag, so the stack stays uniform and the parameter count exact.

- ResFormer's lambdas (`ValueResidualLambdas`): the scalar weights of V_1 and V_n per layer.
- The per-token mix (`lambda_mode='per_token'`) lives in the stacked Attention (`w_mix`).
- Value embeddings (`ValueEmbeddings`): token-embedding tables, looked up per layer, gated.
- CLA (`SharedKeyValues`): W_K, W_V of the stacked layers that own a K/V group.
- DenseFormer (`DepthWeights`): the depth-weighted average after every block.
- MUDD (`DenseConnections`): per-position mixes of all block outputs, one per input of the next block.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis
from vrl.model import ops, params
from vrl.model.cache import layout_of
from vrl.model.config import ModelConfig

Array = jax.Array

VALUE_EMBED_GATE_SCALE = 2.0  # gate = 2 * sigmoid(x W): 1 at W = 0 (the init), room to grow or shut


def gate(x_BxLxD: Array, w_DxK: Array, project: Callable[..., Array]) -> Array:
    """sigmoid(x W) per token and kv head, shaped (B, L, K, 1) to scale values (B, L, K, Dh); x W by
    `project` (one of vrl.model.ops' HandVjpOps)."""
    return jax.nn.sigmoid(project(x_BxLxD, w_DxK.astype(x_BxLxD.dtype), 1, jnp.float32))[..., None]


def spread(x_MxA: Array, index_N: np.ndarray) -> Array:
    """Rows of x at index_N; index M (one past the end) gives a row of zeros: (M, ...) -> (N, ...)."""
    return jnp.concatenate([x_MxA, jnp.zeros_like(x_MxA[:1])])[index_N]


def _owner_index(owned: tuple[bool, ...]) -> np.ndarray:
    """For each entry, its position among the owned ones, or len(owned ones) where not owned."""
    rank = np.cumsum(owned) - 1
    return np.where(owned, rank, sum(owned)).astype(np.int32)


class Lambdas(NamedTuple):
    """ResFormer's value mix for one layer (scalars) or for all stacked layers (N,)."""

    v1: Array  # lambda_1, the weight of V_1
    vn: Array  # lambda_2, the weight of this layer's own V_n


class ValueResidualLambdas(nnx.Module):
    """ResFormer's (lambda_1, lambda_2) for layers 2..L, each of shape (N,).

    identity: 0.5 / 0.5. constant: cfg.lambda1 / cfg.lambda2 everywhere. learnable: per-layer
    parameters, both initialised to 0.5. learnable_plus: lambda_2 per layer (init 0.5) and
    lambda_1 = s * softmax(w) over layers 2..L, w init 0 and s shared, init L. sparse:
    cfg.lambda1 / cfg.lambda2 on cfg.sparse_layers, vanilla (0 / 1) elsewhere.
    Fixed modes hold no parameters. (per_token has no scalars: see Attention.w_mix.)
    """

    def __init__(self, cfg: ModelConfig):
        N, mode = cfg.n_stacked, cfg.lambda_mode
        self.mode = mode
        if mode == 'learnable':
            self.v1 = params.constant(np.full(N, 0.5), (Axis.LAYERS,))
            self.vn = params.constant(np.full(N, 0.5), (Axis.LAYERS,))
        elif mode == 'learnable_plus':
            self.vn = params.constant(np.full(N, 0.5), (Axis.LAYERS,))
            self.w = params.constant(np.zeros(N), (Axis.LAYERS,))
            self.s = params.constant(float(cfg.n_layers), ())
        else:
            if mode == 'identity':
                v1, vn = [0.5] * N, [0.5] * N
            elif mode == 'constant':
                v1, vn = [cfg.lambda1] * N, [cfg.lambda2] * N
            else:  # sparse; stacked index i is layer i + 2
                chosen = [i + 2 in cfg.sparse_layers for i in range(N)]
                v1 = [cfg.lambda1 if c else 0.0 for c in chosen]
                vn = [cfg.lambda2 if c else 1.0 for c in chosen]
            self.fixed = (tuple(v1), tuple(vn))  # static: not parameters

    def for_stack(self) -> Lambdas:
        if self.mode == 'learnable':
            return Lambdas(v1=self.v1[...], vn=self.vn[...])
        if self.mode == 'learnable_plus':
            return Lambdas(v1=self.s[...] * jax.nn.softmax(self.w[...]), vn=self.vn[...])
        return Lambdas(v1=jnp.array(self.fixed[0], jnp.float32), vn=jnp.array(self.fixed[1], jnp.float32))


class ValueEmbed(NamedTuple):
    """One layer's value embedding (or N stacked layers'): zeros where a layer has none."""

    e: Array  # (B, L, K, Dh) the lookup of each position's token in the layer's table
    gate_w: Array  # (D, K) the gate's weight: V_n += 2 * sigmoid(x W) * e


class ValueEmbeddings(nnx.Module):
    """Token-embedding tables (T, V, K, Dh) mixed into V of cfg.value_embed_layers, each through a
    learned gate per token and kv head (weights (D, K) per layer, init 0: gate 1). Layers listing
    the same table id share it. The lookups are recomputed from the token ids: no extra KV cache."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        table_ids = cfg.value_embed_table_ids
        shape = (max(table_ids) + 1, cfg.padded_vocab_size, cfg.n_kv_heads, cfg.head_dim)
        self.tables = params.normal(rngs, shape, (None, Axis.VOCAB, Axis.KV_HEADS, Axis.HEAD_DIM), cfg.init_std)
        self.gates = params.constant(
            np.zeros((cfg.d_model, cfg.n_kv_heads)), (Axis.EMBED, Axis.KV_HEADS), len(table_ids)
        )
        by_layer = dict(zip((n - 1 for n in cfg.value_embed_layers), range(len(table_ids))))
        self.entry_of_layer = tuple(by_layer.get(layer) for layer in range(cfg.n_layers))  # static
        self.table_ids = tuple(table_ids)

    def _lookups(self, tokens_BxL: Array, entries: list[int], dtype) -> Array:
        tables = self.tables[...].astype(dtype)
        return jnp.stack([tables[self.table_ids[i]][tokens_BxL] for i in entries])

    def for_first(self, tokens_BxL: Array, dtype) -> ValueEmbed | None:
        entry = self.entry_of_layer[0]
        if entry is None:
            return None
        return ValueEmbed(self._lookups(tokens_BxL, [entry], dtype)[0], self.gates[...][entry])

    def for_stack(self, tokens_BxL: Array, dtype) -> ValueEmbed | None:
        """(N, ...) for layers 2..L; layers without a value embedding get zeros (adds nothing). None
        when none of them has one (layer 1's alone: SVFormer's)."""
        stacked = self.entry_of_layer[1:]
        entries = [e for e in stacked if e is not None]
        if not entries:
            return None
        index_N = _owner_index(tuple(e is not None for e in stacked))
        return ValueEmbed(
            spread(self._lookups(tokens_BxL, entries, dtype), index_N),
            spread(self.gates[...][np.asarray(entries, np.int32)], index_N),
        )


class LayerKV(NamedTuple):
    """CLA: a layer's W_K and W_V (zeros where it borrows) and whether it projects its own, or N stacked."""

    wk: Array  # (D, K, Dh)
    wv: Array | None  # (D, K, Dh); None for SVFormer, whose layers >= 2 have no W_V
    k_norm: Array | None  # (Dh,): QK-norm's key scale; None without model.qk_norm
    owns: bool | None  # known when tracing: set where the layer runs (Decoder._stacked_layers); None when stacked


class SharedKeyValues(nnx.Module):
    """CLA: W_K (and W_V) of the stacked layers that begin a group of cfg.kv_share layers; the rest of
    a group attends with its first layer's keys and values."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, K, Dh, std = cfg.d_model, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
        self.owned = tuple(layout_of(cfg).owns_kv(layer) for layer in range(1, cfg.n_layers))  # static, layers 2..L
        owners = sum(self.owned)
        self.wk = params.normal(rngs, (D, K, Dh), (Axis.EMBED, Axis.KV_HEADS, Axis.HEAD_DIM), std, owners)
        self.wv = (
            None
            if cfg.attention == 'svformer'
            else params.normal(rngs, (D, K - cfg.skip_v1, Dh), (Axis.EMBED, Axis.KV_HEADS, Axis.HEAD_DIM), std, owners)
        )  # SkipV1Former: the own value heads (the rest are V_1's)
        self.k_norm = params.constant(np.ones(Dh), (Axis.HEAD_DIM,), owners) if cfg.qk_norm else None

    def for_stack(self) -> LayerKV:
        index_N = _owner_index(self.owned)
        wv, k_norm = (None if w is None else spread(w[...], index_N) for w in (self.wv, self.k_norm))
        return LayerKV(spread(self.wk[...], index_N), wv, k_norm, None)


class DepthWeights(nnx.Module):
    """DenseFormer's depth-weighted averages: after block i (1..L) the next input is
    sum_{j <= i} alpha_ij B_j over the embedding output B_0 and the block outputs B_1..B_i.
    L (L + 3) / 2 weights, initialised to the identity (alpha_ii = 1, the rest 0): vanilla."""

    def __init__(self, cfg: ModelConfig):
        L = self.n_layers = cfg.n_layers
        rows, cols = np.tril_indices(L, k=1, m=L + 1)  # row i is block i + 1
        self.rows, self.cols = tuple(rows.tolist()), tuple(cols.tolist())  # static
        self.alpha = params.constant(cols == rows + 1, (None,))

    def matrix(self) -> Array:
        """(L, L + 1): row i weighs B_0..B_{i+1}; the entries past the block are 0."""
        L = self.n_layers
        return jnp.zeros((L, L + 1), jnp.float32).at[np.asarray(self.rows), np.asarray(self.cols)].set(self.alpha[...])


class MuddWeights(NamedTuple):
    """The MUDD connection after a layer, padded to the widest (zeros past its own), or those after
    several layers (a leading axis). After a layer without one: zero weights and a static one-hot on
    the newest output."""

    w_in: Array  # (D, Hmax): RMSNorm(newest output) -> the hidden layer (GELU)
    w_out: Array  # (Hmax, C, L + 1): the hidden layer -> per-position weights of each way over B_0..B_L
    static: Array  # (C, L + 1): added to them


class DenseConnections(nnx.Module):
    """MUDD: after 0-based layer i (cfg.mudd_after(i) non-empty), each way c of the C = len(cfg.mudd)
    ways of the next block's input (the last way, r, its residual) is sum_j w_cj B_j over the embedding
    output B_0 and the block outputs B_1..B_{i+1}, with per-position weights

        w_cj = (GELU(RMSNorm(B_{i+1}) W_in) W_out)_cj + static_cj   (RMSNorm without a scale).

    Parameters per connection, in the authors' shapes: W_in (D, H_i), W_out (H_i, C_i (i + 2)) and
    static (C_i, i + 2), C_i = 1 after the last layer (H_i: cfg.mudd_hidden). W_in ~ N(0, 1 / D) and
    W_out = 0 as the authors initialise them, static one-hot on the newest output: vanilla at the start."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, ways = cfg.n_layers, cfg.d_model, cfg.mudd
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


def weighted_sum(weights: Array, blocks: Array | tuple[Array, ...]) -> Array:
    """sum_j weights[..., j] B_j over the outputs so far: a (J, B, L, D) buffer (weights (J,), or
    (B, L, J) per position), or a tuple of (B, L, D) outputs, each read where it lies (weights past
    the tuple's end are zero and skipped). A buffer is what the layer scan carries; unrolled layers
    hand on a tuple, which keeps each output once for the backward pass."""
    per_position = weights.ndim == 3
    if not isinstance(blocks, tuple):
        return jnp.einsum('blj,jbld->bld' if per_position else 'j,jbld->bld', weights.astype(blocks.dtype), blocks)
    scale = (lambda j: weights[..., j, None]) if per_position else (lambda j: weights[j])
    return sum(scale(j).astype(b.dtype) * b for j, b in enumerate(blocks))


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
