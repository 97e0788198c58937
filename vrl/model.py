"""A Llama-style decoder with value residual learning: vanilla, ResFormer and SVFormer.

Shape suffixes: B batch, L query length, S key length, D d_model, H query heads,
K kv heads, G = H // K heads per kv head, Dh head dim, F d_ff, V padded vocab,
N = n_layers - 1 stacked layers.

Layer 1 runs on its own and creates V_1 (its value projection of its normalised input,
before GQA grouping, not detached). Layers 2..L are one stacked `Block` whose parameters
carry a leading `layers` axis; `jax.lax.scan` walks them carrying `(hidden, V_1)`.
The variant acts in exactly one place, `Attention.value_states`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from vrl import ops
from vrl.config import ModelConfig
from vrl.sharding import constrain

Array = jax.Array


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
           stack: int | None) -> nnx.Param:
    """A float32 N(0, std) weight with logical axis names; `stack` prepends a layers axis."""
    if stack is not None:
        shape, axes = (stack, *shape), ('layers', *axes)
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _constant(value: Array, axes: tuple[str, ...], stack: int | None) -> nnx.Param:
    if stack is not None:
        value, axes = jnp.broadcast_to(value, (stack, *value.shape)), ('layers', *axes)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, stack: int | None):
        self.scale = _constant(jnp.ones((cfg.d_model,), jnp.float32), ('embed',), stack)
        self.eps = cfg.norm_eps

    def __call__(self, x_BxLxD: Array) -> Array:
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...]).astype(x_BxLxD.dtype)


def rope(x_BxLxNxDh: Array, positions_BxL: Array, theta: float) -> Array:
    """Rotary embedding, rotate-half convention; computed in float32."""
    half = x_BxLxNxDh.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_BxLx1xHalf = (positions_BxL.astype(jnp.float32)[..., None] * inv_freq)[:, :, None, :]
    sin, cos = jnp.sin(angles_BxLx1xHalf), jnp.cos(angles_BxLx1xHalf)
    x1, x2 = jnp.split(x_BxLxNxDh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxDh.dtype)


def attend(q_BxLxHxDh: Array, k_BxSxKxDh: Array, v_BxSxKxDh: Array, mask_BxLxS: Array,
           causal_chunks: int = 1) -> Array:
    """Softmax attention with grouped kv heads (no repetition); logits and softmax in float32.

    causal_chunks > 1 promises a causal mask over queries at the last L of the S key positions:
    the queries are split into that many chunks, and each chunk skips the keys after its last
    query, which it cannot see. With 1 chunk every query sees all S keys (decoding).
    """
    B, L, H, Dh = q_BxLxHxDh.shape
    S, K = k_BxSxKxDh.shape[1:3]
    q_BxLxKxGxDh = q_BxLxHxDh.reshape(B, L, K, H // K, Dh)
    bounds = sorted({L * i // causal_chunks for i in range(causal_chunks + 1)})
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        seen = S - L + end  # keys [0, seen) are all the chunk's queries can see
        outs.append(ops.attention(q_BxLxKxGxDh[:, start:end], k_BxSxKxDh[:, :seen], v_BxSxKxDh[:, :seen],
                                  mask_BxLxS[:, start:end, :seen]))
    return jnp.concatenate(outs, axis=1).reshape(B, L, H, Dh)


class LayerCache(NamedTuple):
    """Cached keys and values (B, S, K, Dh) of one layer, or of N stacked layers (N, B, S, K, Dh).

    v is None for SVFormer's layers >= 2: they attend over layer 1's cached values (V_1).
    ResFormer caches the already-mixed values, so its cache is vanilla's size.
    """
    k: Array
    v: Array | None


class KVCache(NamedTuple):
    first: LayerCache  # layer 1; its values are V_1
    layers: LayerCache  # layers 2..L, stacked
    index: Array  # int32 scalar: cache positions [0, index) are filled


class Lambdas(NamedTuple):
    """ResFormer's value mix for one layer (scalars) or for all stacked layers (N,)."""
    v1: Array  # lambda_1, the weight of V_1
    vn: Array  # lambda_2, the weight of this layer's own V_n


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, has_value_proj: bool, stack: int | None, rngs: nnx.Rngs):
        D, H, K, Dh, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
        self.wq = _param(rngs, (D, H, Dh), ('embed', 'heads', 'head_dim'), std, stack)
        self.wk = _param(rngs, (D, K, Dh), ('embed', 'kv_heads', 'head_dim'), std, stack)
        self.wv = _param(rngs, (D, K, Dh), ('embed', 'kv_heads', 'head_dim'), std, stack) if has_value_proj else None
        self.wo = _param(rngs, (H, Dh, D), ('heads', 'head_dim', 'embed'), std, stack)
        self.variant = cfg.attention
        self.rope_theta = cfg.rope_theta
        self.causal_chunks = cfg.attention_chunks

    def project_values(self, x_BxLxD: Array) -> Array:
        return ops.project(x_BxLxD, self.wv[...].astype(x_BxLxD.dtype), 1)

    def value_states(self, x_BxLxD: Array, v1_BxLxKxDh: Array | None, lambdas: Lambdas | None) -> Array:
        """The values this layer attends over; the only place the variant is read.

        Layer 1 (v1 is None) projects its own values, which become V_1 for every variant.
        """
        if v1_BxLxKxDh is None or self.variant == 'vanilla':
            return self.project_values(x_BxLxD)
        if self.variant == 'svformer':
            return v1_BxLxKxDh
        v_BxLxKxDh = self.project_values(x_BxLxD)
        dtype = v_BxLxKxDh.dtype
        return lambdas.vn.astype(dtype) * v_BxLxKxDh + lambdas.v1.astype(dtype) * v1_BxLxKxDh

    def qk(self, x_BxLxD: Array, positions_BxL: Array) -> tuple[Array, Array]:
        dtype = x_BxLxD.dtype
        q = ops.project(x_BxLxD, self.wq[...].astype(dtype), 1)
        k = ops.project(x_BxLxD, self.wk[...].astype(dtype), 1)
        return rope(q, positions_BxL, self.rope_theta), rope(k, positions_BxL, self.rope_theta)

    def output(self, o_BxLxHxDh: Array) -> Array:
        return ops.project(o_BxLxHxDh, self.wo[...].astype(o_BxLxHxDh.dtype), 2)


class MLP(nnx.Module):
    """SwiGLU: (silu(x W_gate) * x W_up) W_down."""

    def __init__(self, cfg: ModelConfig, *, stack: int | None, rngs: nnx.Rngs):
        D, F, std = cfg.d_model, cfg.d_ff, cfg.init_std
        self.w_gate = _param(rngs, (D, F), ('embed', 'mlp'), std, stack)
        self.w_up = _param(rngs, (D, F), ('embed', 'mlp'), std, stack)
        self.w_down = _param(rngs, (F, D), ('mlp', 'embed'), std, stack)

    def __call__(self, x_BxLxD: Array) -> Array:
        dtype = x_BxLxD.dtype
        gate_BxLxF = ops.project(x_BxLxD, self.w_gate[...].astype(dtype), 1)
        up_BxLxF = ops.project(x_BxLxD, self.w_up[...].astype(dtype), 1)
        return ops.project(ops.swiglu(gate_BxLxF, up_BxLxF), self.w_down[...].astype(dtype), 1)


class Block(nnx.Module):
    """Pre-norm attention + SwiGLU. With `stack`, one module holds N layers' parameters."""

    def __init__(self, cfg: ModelConfig, *, has_value_proj: bool, stack: int | None, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, stack)
        self.attn = Attention(cfg, has_value_proj=has_value_proj, stack=stack, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, stack)
        self.mlp = MLP(cfg, stack=stack, rngs=rngs)

    def __call__(self, h_BxLxD: Array, v1_BxLxKxDh: Array | None, lambdas: Lambdas | None,
                 positions_BxL: Array, mask_BxLxS: Array, cache: LayerCache | None = None,
                 index: Array | None = None, v1_cache_BxSxKxDh: Array | None = None
                 ) -> tuple[Array, Array, LayerCache | None]:
        """Returns the new hidden state, this layer's values for the L new tokens (V_1 for layer 1)
        and, when decoding, its cache with the new keys and values written at `index`."""
        x_BxLxD = self.attn_norm(h_BxLxD)
        v_BxLxKxDh = self.attn.value_states(x_BxLxD, v1_BxLxKxDh, lambdas)
        q, k = self.attn.qk(x_BxLxD, positions_BxL)
        keys, values = k, v_BxLxKxDh
        if cache is not None:
            keys = jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), index, axis=1)
            if cache.v is None:
                values = v1_cache_BxSxKxDh
            else:
                values = jax.lax.dynamic_update_slice_in_dim(cache.v, values.astype(cache.v.dtype), index, axis=1)
            cache = LayerCache(keys, None if cache.v is None else values)
        chunks = self.attn.causal_chunks if cache is None else 1  # without a cache the mask is causal
        h_BxLxD = h_BxLxD + self.attn.output(attend(q, keys.astype(q.dtype), values.astype(q.dtype), mask_BxLxS,
                                                    chunks))
        h_BxLxD = h_BxLxD + self.mlp(self.mlp_norm(h_BxLxD))
        return h_BxLxD, v_BxLxKxDh, cache


class ValueResidualLambdas(nnx.Module):
    """ResFormer's (lambda_1, lambda_2) for layers 2..L, each of shape (N,).

    identity: 0.5 / 0.5. constant: cfg.lambda1 / cfg.lambda2 everywhere. learnable: per-layer
    parameters, both initialised to 0.5. learnable_plus: lambda_2 per layer (init 0.5) and
    lambda_1 = s * softmax(w) over layers 2..L, w init 0 and s shared, init L. sparse:
    cfg.lambda1 / cfg.lambda2 on cfg.sparse_layers, vanilla (0 / 1) elsewhere.
    Fixed modes hold no parameters.
    """

    def __init__(self, cfg: ModelConfig):
        N, mode = cfg.n_stacked, cfg.lambda_mode
        self.mode = mode
        if mode == 'learnable':
            self.v1 = _constant(jnp.full((N,), 0.5), ('layers',), None)
            self.vn = _constant(jnp.full((N,), 0.5), ('layers',), None)
        elif mode == 'learnable_plus':
            self.vn = _constant(jnp.full((N,), 0.5), ('layers',), None)
            self.w = _constant(jnp.zeros((N,)), ('layers',), None)
            self.s = _constant(jnp.array(float(cfg.n_layers)), (), None)
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

    def __call__(self) -> Lambdas:
        if self.mode == 'learnable':
            return Lambdas(v1=self.v1[...], vn=self.vn[...])
        if self.mode == 'learnable_plus':
            return Lambdas(v1=self.s[...] * jax.nn.softmax(self.w[...]), vn=self.vn[...])
        return Lambdas(v1=jnp.array(self.fixed[0], jnp.float32), vn=jnp.array(self.fixed[1], jnp.float32))


_ACTIVATION = ('batch', 'length', 'act_embed')  # the hidden state between blocks

_REMAT_POLICIES = {
    'full': None,
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def causal_mask(segment_ids_BxL: Array | None, B: int, L: int) -> Array:
    """True where query i may attend key j: j <= i and, with segment ids, the same document."""
    mask_LxL = jnp.tril(jnp.ones((L, L), jnp.bool_))
    if segment_ids_BxL is None:
        return jnp.broadcast_to(mask_LxL, (B, L, L))
    return mask_LxL & (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        V, D = cfg.padded_vocab_size, cfg.d_model
        self.embed = _param(rngs, (V, D), ('vocab', 'embed'), cfg.init_std, None)
        self.first = Block(cfg, has_value_proj=True, stack=None, rngs=rngs)
        self.layers = Block(cfg, has_value_proj=cfg.attention != 'svformer', stack=cfg.n_stacked, rngs=rngs)
        self.lambdas = ValueResidualLambdas(cfg) if cfg.attention == 'resformer' else None
        self.final_norm = RMSNorm(cfg, None)
        self.head = None if cfg.tie_embeddings else _param(rngs, (D, V), ('embed', 'vocab'), cfg.init_std, None)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.cfg.compute_dtype)

    def __call__(self, tokens_BxL: Array, positions_BxL: Array | None = None,
                 segment_ids_BxL: Array | None = None) -> Array:
        """Float32 logits (B, L, V); padded vocab entries are -1e30.

        positions default to 0..L-1; with segment ids, attention stays within a document.
        """
        return self.logits(self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL))

    def hidden(self, tokens_BxL: Array, positions_BxL: Array | None = None,
               segment_ids_BxL: Array | None = None) -> Array:
        """The final-normalised hidden states (B, L, D) that `head_DxV` turns into logits."""
        B, L = tokens_BxL.shape
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(L), (B, L))
        h_BxLxD, _ = self._forward(tokens_BxL, positions_BxL, causal_mask(segment_ids_BxL, B, L), None)
        return h_BxLxD

    def decode(self, tokens_BxT: Array, pad_B: Array, cache: KVCache) -> tuple[Array, KVCache]:
        """Runs T new tokens at cache positions [index, index + T) of left-padded sequences.

        pad_B: how many cache positions at the start of each sequence are padding. Each new
        token attends to the real tokens up to itself; RoPE positions count real tokens only.
        """
        B, T = tokens_BxT.shape
        S = cache.first.k.shape[1]
        query_index_BxT = jnp.broadcast_to(cache.index + jnp.arange(T), (B, T))
        key_index_S = jnp.arange(S)
        mask_BxTxS = ((key_index_S[None, None, :] <= query_index_BxT[:, :, None])
                      & (key_index_S[None, None, :] >= pad_B[:, None, None]))
        h_BxTxD, cache = self._forward(tokens_BxT, query_index_BxT - pad_B[:, None], mask_BxTxS, cache)
        return self.logits(h_BxTxD), cache

    def _forward(self, tokens_BxL: Array, positions_BxL: Array, mask_BxLxS: Array,
                 cache: KVCache | None) -> tuple[Array, KVCache | None]:
        """The final-normalised hidden states (B, L, D) and, when decoding, the updated cache."""
        index = None if cache is None else cache.index
        h_BxLxD = constrain(self.embed[...].astype(self.compute_dtype)[tokens_BxL], _ACTIVATION)
        h_BxLxD, v1_BxLxKxDh, first_cache = self.first(
            h_BxLxD, None, None, positions_BxL, mask_BxLxS, None if cache is None else cache.first, index)
        h_BxLxD, layers_cache = self._stacked_layers(
            h_BxLxD, v1_BxLxKxDh, positions_BxL, mask_BxLxS, None if cache is None else cache.layers, index,
            None if cache is None else first_cache.v)
        h_BxLxD = self.final_norm(h_BxLxD)
        if cache is None:
            return h_BxLxD, None
        return h_BxLxD, KVCache(first_cache, layers_cache, cache.index + tokens_BxL.shape[1])

    def _stacked_layers(self, h_BxLxD: Array, v1_BxLxKxDh: Array, positions_BxL: Array, mask_BxLxS: Array,
                        caches: LayerCache | None, index: Array | None, v1_cache_BxSxKxDh: Array | None
                        ) -> tuple[Array, LayerCache | None]:
        """Layers 2..L: a scan (or loop) over the stacked parameters (and caches), carrying (h, V_1)."""
        graphdef, stacked_state = nnx.split(self.layers)
        lambdas_N = self.lambdas() if self.lambdas is not None else None

        def body(carry, per_layer):
            h, v1 = carry
            layer_state, lambdas, cache = per_layer
            h, _, cache = nnx.merge(graphdef, layer_state)(h, v1, lambdas, positions_BxL, mask_BxLxS, cache,
                                                           index, v1_cache_BxSxKxDh)
            return (constrain(h, _ACTIVATION), v1), cache

        if self.cfg.remat != 'none':
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        carry, per_layer = (h_BxLxD, v1_BxLxKxDh), (stacked_state, lambdas_N, caches)
        if self.cfg.scan_layers:
            (h_BxLxD, _), caches = jax.lax.scan(body, carry, per_layer)
            return h_BxLxD, caches
        outputs = []
        for i in range(self.cfg.n_stacked):
            carry, cache = body(carry, jax.tree.map(lambda x: x[i], per_layer))
            outputs.append(cache)
        return carry[0], None if caches is None else jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)

    def head_DxV(self) -> Array:
        """The output head in the compute dtype: the embedding transposed when tied."""
        head_DxV = self.embed[...].T if self.head is None else self.head[...]
        return head_DxV.astype(self.compute_dtype)

    def logits(self, x_BxLxD: Array) -> Array:
        logits_BxLxV = ops.project(x_BxLxD, self.head_DxV(), 1, jnp.float32)
        is_real_V = jnp.arange(logits_BxLxV.shape[-1]) < self.cfg.vocab_size
        return constrain(jnp.where(is_real_V, logits_BxLxV, -1e30), ('batch', 'length', 'vocab'))
