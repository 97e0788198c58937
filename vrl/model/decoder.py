"""A Llama-style decoder with value residual learning, its baselines and its later family.

Shape suffixes: B batch, L query length, S key length, D d_model, H query heads,
K kv heads, G = H // K heads per kv head, Dh head dim, F d_ff, V padded vocab,
N = n_layers - 1 stacked layers.

Layer 1 runs on its own and creates V_1 (its value projection of its normalised input,
before GQA grouping, not detached). Layers 2..L are one stacked `Block` whose parameters
carry a leading `layers` axis; `jax.lax.scan` walks them (decoding: a Python loop) carrying
a `Stream`: the residual stream, V_1, and what the baselines need (CLA's shared K/V, a depth
history, the KV cache). Every variant changes one of four things, each in one place:

- the values a layer attends over (ResFormer, SVFormer, the per-token mix, value
  embeddings): `Block.keys_values`, through `Attention.values`;
- what is added to the attention output (NeuTRENO: lambda (V_1 - the values attended)): `Block.__call__`;
- which layer's K/V a layer uses (CLA): `Attention.keys_values`;
- how the layers connect, the residual stream (model.residual: plain, DenseFormer, MUDD,
  hyper-connections, attention residuals): vrl/model/residual/, one module per method, whose hooks
  `Block.__call__` (a sublayer's input, the add after it) and `Decoder._layer` (what a layer hands
  the next) call.

`Block.__call__` reads as a pre-norm block: its inputs normalised, the queries, the keys and the
values, attention (training's `attend` over the L tokens or decoding's `attend_cached` over the KV
cache), then each sublayer's output added to the stream. The tensors a remat policy may keep are
named with `checkpoint_name` ('queries', 'keys', 'v1', 'values', 'attention_out'); model.remat=save_qkv
keeps the first four.

QK-norm (model.qk_norm), beside the variants, normalises each head's queries and keys before RoPE:
`head_rms_norm`, in `Attention.queries` and `Attention.keys_values`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from vrl.core.config import require_resolved
from vrl.core.sharding import Axis, constrain, context_parts
from vrl.model import attention, history_scan, layer_stats, ops, params, residual, variants
from vrl.model.attention import Causal
from vrl.model.cache import KVCache, layout_of
from vrl.model.config import ModelConfig
from vrl.model.norms import RMSNorm
from vrl.model.variants import Lambdas, LayerKV, ValueEmbed

Array = jax.Array


def head_rms_norm(x_BxLxNxDh: Array, scale_Dh: Array | None, eps: float) -> Array:
    """QK-norm: each head's vector RMS-normalised over head_dim and scaled (float32 inside); `x` as is
    where the model has none (scale None)."""
    if scale_Dh is None:
        return x_BxLxNxDh
    x = ops.rms_normalized(x_BxLxNxDh, eps)
    return (x * scale_Dh[None, None, None, :]).astype(x_BxLxNxDh.dtype)


def rope(x_BxLxNxDh: Array, positions_BxL: Array, theta: float) -> Array:
    """Rotary embedding, rotate-half convention; computed in float32."""
    half = x_BxLxNxDh.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_BxLx1xHalf = (positions_BxL.astype(jnp.float32)[..., None] * inv_freq[None, None, :])[:, :, None, :]
    sin, cos = jnp.sin(angles_BxLx1xHalf), jnp.cos(angles_BxLx1xHalf)
    x1, x2 = jnp.split(x_BxLxNxDh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxDh.dtype)


class CachedQueries(NamedTuple):
    """Decoding's mask, made per layer over the keys its cache gives it: T new tokens at cache
    indices `index_BxT` of left-padded sequences (`pad_B` padding positions first) see the real
    tokens up to themselves, within model.attention_window in a local layer."""

    index_BxT: Array
    pad_B: Array

    def over(self, key_index_S: Array, window: int) -> Array:
        """(B, T, S): which of the keys at token indices key_index_S (negative: none) each query sees."""
        query_BxTx1, key_1x1xS = self.index_BxT[:, :, None], key_index_S[None, None, :]
        seen = (key_1x1xS <= query_BxTx1) & (key_1x1xS >= self.pad_B[:, None, None])
        return seen & (query_BxTx1 - key_1x1xS < window) if window else seen


class Attention(nnx.Module):
    """W_Q and W_O; W_K and W_V where the layer owns them (CLA keeps the stacked owners' in
    variants.SharedKeyValues, SVFormer's layers >= 2 have no W_V); the per-token mix's W_mix."""

    def __init__(self, cfg: ModelConfig, *, first: bool, stack: int | None, rngs: nnx.Rngs):
        D, H, K, Dh, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
        owns_kv = first or cfg.kv_share == 1
        self.wq = params.normal(rngs, (D, H, Dh), (Axis.EMBED, Axis.HEADS, Axis.HEAD_DIM), std, stack)
        kv_axes = (Axis.EMBED, Axis.KV_HEADS, Axis.HEAD_DIM)
        self.wk = params.normal(rngs, (D, K, Dh), kv_axes, std, stack) if owns_kv else None
        own_values = K if first else K - cfg.skip_v1  # SkipV1Former: the rest are V_1's
        self.wv = (
            params.normal(rngs, (D, own_values, Dh), kv_axes, std, stack)
            if owns_kv and (first or cfg.attention != 'svformer')
            else None
        )
        self.wo = params.normal(rngs, (H, Dh, D), (Axis.HEADS, Axis.HEAD_DIM, Axis.EMBED), std, stack)
        self.q_norm = params.constant(np.ones(Dh), (Axis.HEAD_DIM,), stack) if cfg.qk_norm else None
        self.k_norm = params.constant(np.ones(Dh), (Axis.HEAD_DIM,), stack) if cfg.qk_norm and owns_kv else None
        self.norm_eps = cfg.norm_eps
        per_token = not first and cfg.per_token_mix
        self.w_mix = params.normal(rngs, (D, K), (Axis.EMBED, Axis.KV_HEADS), std, stack) if per_token else None
        self.variant = cfg.attention
        self.rope_theta = cfg.rope_theta
        self.hand_vjp = cfg.hand_vjp

    @property
    def ops(self) -> ops.HandVjpOps:
        return ops.hand_vjp_ops(self.hand_vjp)  # at call time: a model is built (for shapes) before hand_vjp resolves

    def queries(self, x_BxLxD: Array, positions_BxL: Array) -> Array:
        q_BxLxHxDh = self.ops.project(x_BxLxD, self.wq[...].astype(x_BxLxD.dtype), 1)
        q_BxLxHxDh = head_rms_norm(q_BxLxHxDh, None if self.q_norm is None else self.q_norm[...], self.norm_eps)
        return rope(q_BxLxHxDh, positions_BxL, self.rope_theta)

    def keys_values(
        self,
        xk_BxLxD: Array,
        xv_BxLxD: Array,
        positions_BxL: Array,
        v1_BxLxKxDh: Array | None,
        kv: LayerKV | None,
        borrowed: tuple[Array, Array] | None,
    ) -> tuple[Array, Array]:
        """Keys (with RoPE) of xk and the layer's own values V_n: xv W_V, or V_1 where the layer has no W_V
        (SkipV1Former's W_V projects its first K - model.skip_v1 heads: V_n has those).

        CLA (kv given): only the first layer of a group projects; the others borrow its keys and
        the values it attended over (`kv.owns` is known when tracing: Decoder._stacked_layers).
        """

        def project(wk_DxKxDh: Array, wv_DxKxDh: Array | None, k_norm_Dh: Array | None) -> tuple[Array, Array]:
            dtype = xk_BxLxD.dtype
            k = head_rms_norm(self.ops.project(xk_BxLxD, wk_DxKxDh.astype(dtype), 1), k_norm_Dh, self.norm_eps)
            k = rope(k, positions_BxL, self.rope_theta)
            return k, v1_BxLxKxDh if wv_DxKxDh is None else self.ops.project(xv_BxLxD, wv_DxKxDh.astype(dtype), 1)

        if kv is None:
            wv, k_norm = (None if w is None else w[...] for w in (self.wv, self.k_norm))
            return project(self.wk[...], wv, k_norm)
        return project(kv.wk, kv.wv, kv.k_norm) if kv.owns else borrowed

    def values(self, x_BxLxD: Array, v_n: Array, v1: Array | None, lambdas: Lambdas | None) -> Array:
        """The values (B, L, K, Dh) this layer attends over: where the variants differ in V.

        Layer 1 (v1 is None) attends over its own V_n, which is V_1 for every variant.
        """
        if v1 is None or self.variant == 'vanilla':
            return v_n
        if self.variant == 'svformer':
            return v1
        if self.w_mix is not None:  # per-token mix: lambda = sigmoid(x W_mix) per token and kv head
            mix_BxLxKx1 = self.mix_gate(x_BxLxD)
            return (mix_BxLxKx1 * v1 + (1 - mix_BxLxKx1) * v_n).astype(v_n.dtype)
        return lambdas.vn.astype(v_n.dtype) * v_n + lambdas.v1.astype(v_n.dtype) * v1

    def mix_gate(self, x_BxLxD: Array) -> Array:
        """The per-token mix's weight of V_1, (B, L, K, 1) in [0, 1]."""
        return variants.gate(x_BxLxD, self.w_mix[...], self.ops.project)

    def output(self, o_BxLxHxDh: Array) -> Array:
        return self.ops.project(o_BxLxHxDh, self.wo[...].astype(o_BxLxHxDh.dtype), 2)


class MLP(nnx.Module):
    """SwiGLU: (silu(x W_gate) * x W_up) W_down."""

    def __init__(self, cfg: ModelConfig, *, stack: int | None, rngs: nnx.Rngs):
        D, F, std = cfg.d_model, cfg.d_ff, cfg.init_std
        self.w_gate = params.normal(rngs, (D, F), (Axis.EMBED, Axis.MLP), std, stack)
        self.w_up = params.normal(rngs, (D, F), (Axis.EMBED, Axis.MLP), std, stack)
        self.w_down = params.normal(rngs, (F, D), (Axis.MLP, Axis.EMBED), std, stack)
        self.hand_vjp = cfg.hand_vjp

    @property
    def ops(self) -> ops.HandVjpOps:
        return ops.hand_vjp_ops(self.hand_vjp)

    def __call__(self, x_BxLxD: Array) -> Array:
        dtype = x_BxLxD.dtype
        gate_BxLxF = self.ops.project(x_BxLxD, self.w_gate[...].astype(dtype), 1)
        up_BxLxF = self.ops.project(x_BxLxD, self.w_up[...].astype(dtype), 1)
        return self.ops.project(self.ops.swiglu(gate_BxLxF, up_BxLxF), self.w_down[...].astype(dtype), 1)


class LayerInputs(NamedTuple):
    """A layer's share of the variants' per-layer inputs; for layers 2..L each has a leading N axis
    that the scan slices."""

    layer: Array | int  # the 0-based layer index: an int where the layers are unrolled (it picks cache slots)
    lambdas: Lambdas | None  # ResFormer's scalar mix
    kv: LayerKV | None  # CLA: the layer's W_K, W_V (zeros where it borrows) and whether it owns them
    value_embed: ValueEmbed | None  # value embeddings: the layer's lookup and gate weight (zeros: none)
    connection: Any  # the residual method's weights after this layer (residual.base.Plain.per_layer), or None


class Stream(NamedTuple):
    """What each layer hands the next: the layer scan's carry."""

    h: Array  # (B, L, D) the residual stream, the next block's input ((n, B, L, D) where it is n streams)
    v1: Array | None  # (B, L, K, Dh) V_1, once layer 1 has run
    copies: attention.Copies | None  # sequences split over `context`: shared keys and values made whole (Block.copies)
    kv: tuple[Array, Array] | None  # CLA: the current group's keys and attended values (B, L, K, Dh)
    # the residual method's depth history (the earlier layers' outputs: a buffer the scan carries, a tuple of
    # (B, L, D) where the layers are unrolled), or None
    history: Any
    cache: KVCache | None  # decoding: every layer's keys and values
    inputs: Array | None = None  # (E, B, L, D) the next attention's own inputs, where the method mixes them apart


class Block(nnx.Module):
    """Pre-norm attention + SwiGLU. With `stack`, one module holds N layers' parameters."""

    def __init__(self, cfg: ModelConfig, *, first: bool, stack: int | None, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, stack)  # of the attention's input (of its queries', where a method mixes apart)
        self.attn = Attention(cfg, first=first, stack=stack, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, stack)
        self.mlp = MLP(cfg, stack=stack, rngs=rngs)
        self.connection = residual.of(cfg)
        for name, module in self.connection.block_params(first=first, stack=stack, rngs=rngs).items():
            setattr(self, name, module)  # the method's parameters, under the names checkpoints keep
        self.cfg = cfg
        self.neutreno_lambda = cfg.neutreno_lambda if cfg.neutreno else None

    def __call__(
        self, s: Stream, p: LayerInputs, positions_BxL: Array, mask: Causal | CachedQueries
    ) -> tuple[Stream, tuple[Array, Array]]:
        """The stream after the block: the residual stream and history (each sublayer's output added as
        the residual method adds it), the copies it attended with (`copies`) and the cache with its keys
        and values written; and those keys and attended values for the L tokens. It sows what its queries
        attended (layer_stats.Attended) for the statistics."""
        x_BxLxD, xk_BxLxD, xv_BxLxD, adding = self.connection.attention_inputs(self, s.h, s.history, s.inputs, p.layer)
        q_BxLxHxDh = checkpoint_name(self.attn.queries(x_BxLxD, positions_BxL), 'queries')
        k_BxLxKxDh, v_BxLxKxDh, gate_BxLxKx1 = self.keys_values(s, p, xk_BxLxD, xv_BxLxD, positions_BxL)  # the V
        if isinstance(mask, Causal):  # training: the L tokens
            mask = (
                mask._replace(window=self.cfg.attention_window, local=self.local(p))
                if self.cfg.attention_window
                else mask
            )
            copies = self.copies(s, p, k_BxLxKxDh, v_BxLxKxDh, mask)
            o_BxLxHxDh, cache = self.attend(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask, copies), None
            attended = (k_BxLxKxDh, v_BxLxKxDh, mask)
        else:  # decoding: the new tokens over the cache
            copies = None
            o_BxLxHxDh, cache, attended = self.attend_cached(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask, s.cache, p)
        if self.neutreno_lambda is not None and s.v1 is not None:  # NeuTRENO: + lambda (V_1 - attended V)
            o_BxLxHxDh = o_BxLxHxDh + _per_query_head(self.neutreno_lambda * (s.v1 - v_BxLxKxDh), o_BxLxHxDh.shape)
        attn_out_BxLxD = checkpoint_name(self.attn.output(o_BxLxHxDh), 'attention_out')
        h, history = self.connection.add(self, s.h, s.history, attn_out_BxLxD, adding, p.layer, 0)  # residual
        x_BxLxD, adding = self.connection.sublayer_input(self, h, history, p.layer, 1)
        mlp_out_BxLxD = self.mlp(self.mlp_norm(x_BxLxD))
        h, history = self.connection.add(self, h, history, mlp_out_BxLxD, adding, p.layer, 1)  # residual
        self.sow(
            nnx.Intermediate,
            'attended',
            layer_stats.Attended(q_BxLxHxDh, *attended, gate_BxLxKx1, self.cfg.attn_logits_soft_cap),
        )
        return s._replace(h=h, history=history, copies=copies, cache=cache), (k_BxLxKxDh, v_BxLxKxDh)

    def keys_values(
        self, s: Stream, p: LayerInputs, xk_BxLxD: Array, xv_BxLxD: Array, positions_BxL: Array
    ) -> tuple[Array, Array, Array | None]:
        """The keys and the values (B, L, K, Dh) this layer attends over, where the variants change V:
        CLA's borrowed K and V, value embeddings added to V_n (and their gate (B, L, K, 1), scaled),
        then ResFormer's mix with V_1 or SVFormer's V_1 (Attention.values); SkipV1Former's last heads
        are V_1's as layer 1 attended them (the mix acts on the layer's own heads)."""
        k_BxLxKxDh, v_n = self.attn.keys_values(xk_BxLxD, xv_BxLxD, positions_BxL, s.v1, p.kv, s.kv)  # CLA
        scale_BxLxKx1 = None
        if p.value_embed is not None:  # value embeddings: V_n + 2 sigmoid(x W_gate) * table[token]
            gate_BxLxKx1 = variants.gate(xv_BxLxD, p.value_embed.gate_w, self.attn.ops.project)
            scale_BxLxKx1 = variants.VALUE_EMBED_GATE_SCALE * gate_BxLxKx1
            v_n = v_n + (scale_BxLxKx1 * p.value_embed.e).astype(v_n.dtype)
        own = v_n.shape[2]  # SkipV1Former: K - model.skip_v1 heads projected, V_1 gives the rest
        v1_own = None if s.v1 is None else s.v1[:, :, :own]
        v_BxLxKxDh = self.attn.values(xv_BxLxD, v_n, v1_own, p.lambdas)  # ResFormer, SVFormer, per-token mix
        if own < self.cfg.n_kv_heads:
            v_BxLxKxDh = jnp.concatenate([v_BxLxKxDh, s.v1[:, :, own:].astype(v_BxLxKxDh.dtype)], axis=2)
        names = ('keys', 'v1' if s.v1 is None else 'values')  # what a remat policy may save (REMAT_POLICIES)
        return checkpoint_name(k_BxLxKxDh, names[0]), checkpoint_name(v_BxLxKxDh, names[1]), scale_BxLxKx1

    def local(self, p: LayerInputs) -> bool | Array:
        """Whether this layer attends within model.attention_window (local/global layers)."""
        return self.cfg.is_local(p.layer) if isinstance(p.layer, int) else jnp.asarray(self.cfg.local_layers)[p.layer]

    def attend(
        self, q_BxLxHxDh: Array, k_BxLxKxDh: Array, v_BxLxKxDh: Array, mask: Causal, copies: attention.Copies | None
    ) -> Array:
        """Training's causal attention over the L tokens; vrl/model/attention.py decides how."""
        dtype = q_BxLxHxDh.dtype
        return attention.attention(
            self.cfg.attention_impl,
            q_BxLxHxDh,
            k_BxLxKxDh.astype(dtype),
            v_BxLxKxDh.astype(dtype),
            mask,
            self.cfg.attention_chunks,
            self.attn.ops.attention,
            copies,
            self.cfg.attn_logits_soft_cap,
        )

    def attend_cached(
        self,
        q_BxTxHxDh: Array,
        k_BxTxKxDh: Array,
        v_BxTxKxDh: Array,
        queries: CachedQueries,
        cache: KVCache,
        p: LayerInputs,
    ) -> tuple[Array, KVCache, tuple[Array, Array, Array]]:
        """Decoding: the T new tokens' keys and values written into the layer's cache slots, then the
        queries attend over the slots as they lie ((B * K, S, Dh)); also what they attended (the keys,
        the values and the (B, T, S) mask) for the statistics."""
        layout = layout_of(self.cfg)
        keys, values, key_index_S, cache = cache.update(layout, p.layer, k_BxTxKxDh, v_BxTxKxDh)
        mask_BxTxS = queries.over(key_index_S, self.cfg.attention_window if self.local(p) else 0)
        keys, values = keys.astype(q_BxTxHxDh.dtype), values.astype(q_BxTxHxDh.dtype)
        o_BxTxHxDh = ops.attend_cache(q_BxTxHxDh, keys, values, mask_BxTxS, self.cfg.attn_logits_soft_cap)
        return o_BxTxHxDh, cache, (keys, values, mask_BxTxS)

    def copies(
        self, s: Stream, p: LayerInputs, k_BxLxKxDh: Array, v_BxLxKxDh: Array, mask: Causal | CachedQueries
    ) -> attention.Copies | None:
        """With sequences split over `context` (training): the whole keys and values this layer attends
        with that later layers share, so they cross the axis once. A layer makes copies of what it projects
        for others (layer 1: SVFormer's V_1; the first layer of a CLA group: its K, and its V unless value
        embeddings make each layer's V its own) and reads those it was handed for what it borrows."""
        if not (isinstance(mask, Causal) and context_parts() > 1):
            return None
        cfg, first, kept = self.cfg, s.v1 is None, s.copies or attention.Copies(None, None)
        projects_shared = cfg.kv_share > 1 and (first or p.kv.owns)
        makes_v = (first and cfg.attention == 'svformer') or (
            projects_shared and cfg.attention != 'svformer' and not cfg.value_embed_layers
        )
        return attention.Copies(
            attention.whole_copies(k_BxLxKxDh) if projects_shared else kept.k,
            attention.whole_copies(v_BxLxKxDh) if makes_v else kept.v,
        )


def _per_query_head(x_BxLxKxDh: Array, shape_BxLxHxDh: tuple[int, ...]) -> Array:
    """A kv head's vector for each of the G query heads of its group: (B, L, K, Dh) -> (B, L, H, Dh)."""
    B, L, K, Dh = x_BxLxKxDh.shape
    G = shape_BxLxHxDh[2] // K
    return jnp.broadcast_to(x_BxLxKxDh[:, :, :, None], (B, L, K, G, Dh)).reshape(shape_BxLxHxDh)


def _in_order(
    order: np.ndarray | None, tokens_BxL: Array, positions_BxL: Array, segment_ids_BxL: Array | None
) -> tuple[Array, Array, Causal]:
    """Tokens, positions and the causal mask with the tokens in `order` (attention.balanced_order:
    a split sequence, each device holding a piece of each end; None: as they come)."""
    if order is None:
        return tokens_BxL, positions_BxL, Causal(segment_ids_BxL)
    ids_BxL = None if segment_ids_BxL is None else segment_ids_BxL[:, order]
    return tokens_BxL[:, order], positions_BxL[:, order], Causal(ids_BxL, order)


def _unstacked(tree, start: int, size: int) -> list:
    """Entries start .. start + size - 1 of a tree whose leaves have a leading stacked axis."""
    return [jax.tree.map(lambda x: x[start + i], tree) for i in range(size)]


def _stacked(trees: list):
    """Trees of arrays -> one tree with a leading axis over them."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


_ACTIVATION = (Axis.BATCH, Axis.LENGTH, Axis.ACT_EMBED)  # the hidden state between blocks
# decoding: the new tokens whole on each device of a sequence, whose cache positions `context` splits
_DECODING = (Axis.BATCH, None, Axis.ACT_EMBED)

_REMAT_POLICIES = {
    'full': None,
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # each layer's projections and attended values (Block's checkpoint_names): the backward recomputes
    # the norms, the attention and the MLP from them
    'save_qkv': jax.checkpoint_policies.save_only_these_names('queries', 'keys', 'v1', 'values'),
}


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        V, D = cfg.padded_vocab_size, cfg.d_model
        self.embed = params.normal(rngs, (V, D), (Axis.VOCAB, Axis.EMBED), cfg.init_std)
        self.first = Block(cfg, first=True, stack=None, rngs=rngs)
        self.layers = Block(cfg, first=False, stack=cfg.n_stacked, rngs=rngs)
        scalar_lambdas = cfg.attention == 'resformer' and not cfg.per_token_mix
        self.lambdas = variants.ValueResidualLambdas(cfg) if scalar_lambdas else None
        self.shared_kv = variants.SharedKeyValues(cfg, rngs) if cfg.kv_share > 1 else None
        self.value_embeds = variants.ValueEmbeddings(cfg, rngs) if cfg.value_embed_layers else None
        self.connection = residual.of(cfg)
        for name, module in self.connection.model_params(rngs).items():
            setattr(self, name, module)  # the method's parameters, under the names checkpoints keep
        self.final_norm = RMSNorm(cfg, None)
        self.head = None if cfg.tie_embeddings else params.normal(rngs, (D, V), (Axis.EMBED, Axis.VOCAB), cfg.init_std)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.cfg.compute_dtype)

    def __call__(
        self, tokens_BxL: Array, positions_BxL: Array | None = None, segment_ids_BxL: Array | None = None
    ) -> Array:
        """Float32 logits (B, L, V); padded vocab entries are -1e30.

        positions default to 0..L-1; with segment ids, attention stays within a document.
        """
        return self.logits(self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL))

    def hidden(
        self, tokens_BxL: Array, positions_BxL: Array | None = None, segment_ids_BxL: Array | None = None
    ) -> Array:
        """The final-normalised hidden states (B, L, D) that `head_DxV` turns into logits, in the
        tokens' order (a sequence split over `context` runs through the layers in
        attention.balanced_order)."""
        B, L = tokens_BxL.shape
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(L), (B, L))
        order = attention.balanced_order(L)
        h_BxLxD, _, _ = self._forward(*_in_order(order, tokens_BxL, positions_BxL, segment_ids_BxL), None)
        return h_BxLxD if order is None else h_BxLxD[:, np.argsort(order)]

    def layer_stats(self, tokens_BxL: Array) -> layer_stats.LayerStats:
        """Per-layer attention, value and hidden-state statistics of causal sequences (vrl/model/layer_stats.py),
        each (L, B), computed one layer at a time; `similarity` (L + 1, B) starts at the embedding."""
        B, L = tokens_BxL.shape
        positions_BxL = jnp.broadcast_to(jnp.arange(L), (B, L))
        order = attention.balanced_order(L)  # no statistic depends on it: each is over all positions or the first's
        with layer_stats.recording():
            _, _, stats = self._forward(*_in_order(order, tokens_BxL, positions_BxL, None), None)
        return stats

    def split_layers(self) -> list[nnx.State]:
        """The stacked layers' parameters as one state per layer (layers 2..L): what the layer loop walks."""
        _, stacked_state = nnx.split(self.layers)
        return [jax.tree.map(lambda x: x[i], stacked_state) for i in range(self.cfg.n_stacked)]

    def decode(
        self, tokens_BxT: Array, pad_B: Array, cache: KVCache, layers: list[nnx.State] | None = None
    ) -> tuple[Array, KVCache]:
        """Runs T new tokens at cache positions [index, index + T) of left-padded sequences.

        pad_B: how many cache positions at the start of each sequence are padding. Each new
        token attends to the real tokens up to itself; RoPE positions count real tokens only.
        layers: `split_layers()`, taken once outside a loop of decode steps. XLA:CPU copies a
        slice of the stacked weights before a matmul reads it, so slicing them every step
        copied every layer's weights every step.
        """
        B, T = tokens_BxT.shape
        query_index_BxT = jnp.broadcast_to(cache.index + jnp.arange(T), (B, T))
        queries = CachedQueries(query_index_BxT, pad_B)
        h_BxTxD, cache, _ = self._forward(tokens_BxT, query_index_BxT - pad_B[:, None], queries, cache, layers)
        return self.logits(h_BxTxD), cache

    def _forward(
        self,
        tokens_BxL: Array,
        positions_BxL: Array,
        mask: Causal | CachedQueries,
        cache: KVCache | None,
        layers: list[nnx.State] | None = None,
    ) -> tuple[Array, KVCache | None, layer_stats.LayerStats | None]:
        """The final-normalised hidden states (B, L, D), the updated cache when decoding, and the
        per-layer statistics while layer_stats.recording()."""
        require_resolved(self.cfg, 'model', 'a Decoder that runs', unused=('model.remat',) if cache is not None else ())
        dtype, L = self.compute_dtype, self.cfg.n_layers
        h_BxLxD = constrain(self.embed[...].astype(dtype)[tokens_BxL], _ACTIVATION if cache is None else _DECODING)
        h, history = self.connection.begin(self, h_BxLxD, self.cfg.scan_layers and cache is None)
        connected = self.connection.per_layer(self)  # a leading axis over the L layers, or None
        ve = self.value_embeds
        first = LayerInputs(
            layer=0,
            lambdas=None,
            kv=None,
            value_embed=None if ve is None else ve.for_first(tokens_BxL, dtype),
            connection=jax.tree.map(lambda x: x[0], connected),
        )
        stacked = LayerInputs(
            layer=jnp.arange(1, L, dtype=jnp.int32),
            lambdas=None if self.lambdas is None else self.lambdas.for_stack(),
            kv=None if self.shared_kv is None else self.shared_kv.for_stack(),
            value_embed=None if ve is None else ve.for_stack(tokens_BxL, dtype),
            connection=jax.tree.map(lambda x: x[1:], connected),
        )
        s, first_stats = self._layer(
            self.first, Stream(h, None, None, None, history, cache), first, positions_BxL, mask
        )
        s, stacked_stats = self._stacked_layers(s, stacked, positions_BxL, mask, layers)
        h_BxLxD = self.final_norm(self.connection.readout(self, s.h, s.history))
        cache = None if cache is None else s.cache._replace(index=cache.index + tokens_BxL.shape[1])
        if first_stats is None:
            return h_BxLxD, cache, None
        stats = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first_stats, stacked_stats)
        embedding_similarity = layer_stats.token_similarity(self.embed[...].astype(dtype)[tokens_BxL])
        gated_Lx1 = np.isin(np.arange(1, L + 1), self.cfg.value_embed_layers)[:, None]  # the stack computes every gate
        return (
            h_BxLxD,
            cache,
            stats._replace(
                similarity=jnp.concatenate([embedding_similarity[None], stats.similarity]),
                value_gate=jnp.where(gated_Lx1, stats.value_gate, jnp.nan),
            ),
        )

    def _layer(
        self, block: Block, s: Stream, p: LayerInputs, positions_BxL: Array, mask: Causal | CachedQueries
    ) -> tuple[Stream, layer_stats.LayerStats | None]:
        """One block, then what it hands on: V_1 (from layer 1), CLA's K/V, the residual method's stream,
        history and the next attention's own inputs (residual.base.Plain.after_layer); and its statistics
        while recording."""
        (out, kv), attended = layer_stats.captured(block, s, p, positions_BxL, mask)
        activation = _ACTIVATION if out.cache is None else _DECODING
        h, history, inputs = self.connection.after_layer(self, out.h, out.history, p.connection, p.layer)
        h = constrain(h, self.connection.stream_axes(activation))
        inputs = None if inputs is None else constrain(inputs, (None, *activation))
        v1 = kv[1] if s.v1 is None else s.v1
        s = Stream(h, v1, out.copies, kv if self.cfg.kv_share > 1 else None, history, out.cache, inputs)
        hidden = None if attended is None else self.connection.hidden(s.h, s.history)
        return s, None if attended is None else layer_stats.layer_stats(attended, hidden)

    def _stacked_layers(
        self,
        s: Stream,
        inputs: LayerInputs,
        positions_BxL: Array,
        mask: Causal | CachedQueries,
        layers: list[nnx.State] | None,
    ) -> tuple[Stream, layer_stats.LayerStats | None]:
        """Layers 2..L: a scan (or loop) over the stacked parameters and per-layer inputs, carrying `s`,
        a CLA group of model.kv_share layers at a time (without CLA, one layer), so that which layer
        projects the group's keys and values is known when tracing: the kv_share - 1 layers that borrow
        layer 1's run first, then the scanned groups, then a shorter last group if any.

        V_1, and the copies layer 1 made (Block.copies), are the same for every layer, so they are
        constants of the scan rather than part of its carry: the backward pass keeps a scan's carry
        once per scanned step (N copies of V_1), and a constant once (docs/performance.md, "Train-step
        memory"). A CLA group's copies live within its step. A residual method's depth history must
        be carried; its scan is history_scan.scan, whose backward keeps the history once and each
        layer's other residuals as jax.lax.scan would (jax.lax.scan keeps every layer's history; it
        still runs while layer statistics are recorded, as they are per-layer outputs). Decoding
        always loops, so that each layer's cache slots are known when tracing (KVCache: one buffer per
        slot), and takes each layer's parameters from `layers` where given (`decode`).
        """
        graphdef, stacked_state = nnx.split(self.layers)
        v1, shared, decoding = s.v1, s.copies, s.cache is not None
        G, N = self.cfg.kv_share, self.cfg.n_stacked
        lead = G - 1  # the stacked layers that borrow layer 1's keys and values
        groups, rest = divmod(N - lead, G)

        def group(s: Stream, per_layer: tuple[list[nnx.State], list[LayerInputs]], start: int, in_scan: bool):
            """Stacked layers start, start + 1, ... one after another (a scanned group's stands for each)."""
            s, outputs = s._replace(v1=v1, copies=shared), []
            for i, (layer_state, p) in enumerate(zip(*per_layer)):
                if not in_scan:  # the layer known when tracing: it picks cache slots and sources as ints
                    p = p._replace(layer=1 + start + i)
                if p.kv is not None:
                    p = p._replace(kv=p.kv._replace(owns=layout_of(self.cfg).owns_kv(1 + start + i)))
                s, stats = self._layer(nnx.merge(graphdef, layer_state), s, p, positions_BxL, mask)
                outputs.append(stats)
            return s._replace(v1=None, copies=None), None if outputs[0] is None else _stacked(outputs)

        def rematted(in_scan: bool):
            """`group`, recomputed in the backward pass under model.remat. Outside a scan, XLA's CSE would
            merge the recomputation with the forward (keeping what remat frees) unless prevented."""
            run = functools.partial(group, in_scan=in_scan)
            if self.cfg.remat == 'none' or decoding:
                return run
            policy = _REMAT_POLICIES[self.cfg.remat]
            return jax.checkpoint(run, policy=policy, prevent_cse=not in_scan, static_argnums=(2,))

        s = s._replace(v1=None, copies=None)
        scan = self.cfg.scan_layers and not decoding
        layers = None if scan else self.split_layers() if layers is None else layers

        def unrolled(s: Stream, start: int, size: int) -> tuple[Stream, layer_stats.LayerStats | None]:
            if size == 0:
                return s, None
            states = _unstacked(stacked_state, start, size) if scan else layers[start : start + size]
            return rematted(in_scan=False)(s, (states, _unstacked(inputs, start, size)), start)

        s, lead_stats = unrolled(s, 0, lead)
        middle = []
        if scan and groups:  # without CLA, the stack as it lies (a group axis of 1 would cost the 468M 8% memory)
            grouped = (
                (stacked_state, inputs)
                if G == 1
                else jax.tree.map(
                    lambda x: x[lead : lead + groups * G].reshape(groups, G, *x.shape[1:]), (stacked_state, inputs)
                )
            )
            per_layer = (lambda x: [x]) if G == 1 else (lambda x: _unstacked(x, 0, G))
            scanned = rematted(in_scan=True)
            history_once = s.history is not None and not layer_stats.is_recording()
            if history_once:  # a history kept once (its scan hands on no per-layer outputs)
                step = lambda s, xs: scanned(s, tuple(map(per_layer, xs)), lead)[0]  # noqa: E731
                s, stats = history_scan.scan(step, s, grouped, self._history(lead, groups)), None
            else:
                s, stats = jax.lax.scan(lambda s, xs: scanned(s, tuple(map(per_layer, xs)), lead), s, grouped)
            middle.append(None if stats is None else jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), stats))
        elif not scan:
            for g in range(groups):
                s, stats = unrolled(s, lead + g * G, G)
                middle.append(stats)
        s, rest_stats = unrolled(s, lead + groups * G, rest)
        outputs = [stats for stats in (lead_stats, *middle, rest_stats) if stats is not None]
        stats = jax.tree.map(lambda *xs: jnp.concatenate(xs), *outputs) if outputs else None
        return s._replace(v1=v1, copies=shared), stats

    def _history(self, lead: int, groups: int) -> history_scan.History:
        """How many entries of the depth history each scanned step starts with (the residual method's
        `written`)."""
        G = self.cfg.kv_share
        return history_scan.History(self.connection.written([1 + lead + i * G for i in range(groups)]))  # 0-based

    def head_DxV(self) -> Array:
        """The output head in the compute dtype: the embedding transposed when tied."""
        head_DxV = self.embed[...].T if self.head is None else self.head[...]
        return head_DxV.astype(self.compute_dtype)

    def logits(self, x_BxLxD: Array) -> Array:
        logits_BxLxV = ops.soft_cap(
            ops.project(x_BxLxD, self.head_DxV(), 1, jnp.float32), self.cfg.final_logits_soft_cap
        )
        is_real_V = jnp.arange(logits_BxLxV.shape[-1]) < self.cfg.vocab_size
        return constrain(jnp.where(is_real_V, logits_BxLxV, -1e30), (Axis.BATCH, Axis.LENGTH, Axis.VOCAB))
