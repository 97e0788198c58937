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

How the layers' outputs combine into the residual stream (DenseFormer, MUDD, hyper-connections, attention
residuals) is vrl/model/residual/'s.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis
from vrl.model import params
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
