"""vrl's decoder in PyTorch, for `transformers` (`trust_remote_code=True`): written into every
directory `python -m vrl.tools.export` makes for a model that is not a plain Llama.

A Llama decoder (pre-RMSNorm, rotate-half RoPE, SwiGLU, no biases) in which each of vrl's
variants changes one thing, as in vrl/model/decoder.py:

- the values a layer attends over: ResFormer mixes lambda_2 V_n + lambda_1 V_1 (scalars per
  layer, or per token and kv head: `mix_proj`), SVFormer's layers >= 2 attend over V_1,
  SkipV1Former's layers >= 2 project their first K - skip_v1 value heads and take the last
  skip_v1 from V_1, value embeddings add 2 sigmoid(x W_gate) * table[token] to V_n:
  `VrlAttention.values_of`;
- which layer's K and V a layer uses (CLA: the first of each group of kv_share layers);
- what is added to the attention output (NeuTRENO: lambda (V_1 - the values attended));
- how block outputs combine into the next block's input (DenseFormer's depth weights, MUDD);
- the residual stream itself (hyper-connections: n streams (n, ..., D), `HyperConnection`; attention
  residuals: each sublayer's input a softmax over the sources before it, `DepthQuery`).

The recipe around them: QK-norm, soft-capping (cap * tanh(x / cap)) of the attention logits and
the final logits (Gemma 2's `attn_logit_softcapping` and `final_logit_softcapping`), and local
layers (`layer_types` 'sliding_attention') whose queries see the `sliding_window` positions up to
themselves; their cache entries keep every position, the mask keeps the window.

The softmax attention itself goes through transformers' attention interface
(`config._attn_implementation`): `sdpa`, PyTorch's fused attention, by default; `eager`
(`eager_attention`, written out) for a soft-capped model, which sdpa cannot cap; and whatever an
engine registers, as vLLM's Transformers backend does with its paged attention.

The KV cache is transformers' DynamicCache with one entry per layer: keys and values, keys and
the layer's own value heads (SkipV1Former's layers >= 2: the rest are V_1's, cached once by layer
1), keys only (SVFormer's layers >= 2: their values are V_1), or nothing (CLA layers that borrow
their group's). Shapes: B batch, T new tokens, S cached + new tokens, D hidden,
H heads, K kv heads, G = H // K, Dh head dim; per-head tensors are heads-major (B, K, T, Dh).

Works with transformers 5.3 and later (vrl/interop/hf.py TRANSFORMERS): the cache comes in as
`cache` (the name generate() passes from 5.24 on) or `past_key_values` (before), and goes out under
the name the installed transformers' output class declares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_vrl import VrlConfig

VALUE_EMBED_GATE_SCALE = 2.0  # gate = 2 sigmoid(x W): 1 at W = 0


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap); x as it is without a cap."""
    return cap * torch.tanh(x / cap) if cap else x


def eager_attention(
    module: nn.Module, q, keys, values, mask_Bx1xTxS, dropout: float = 0.0, scaling: float = 1.0, softcap=None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention written out, transformers' `eager` implementation: q (B, H, T, Dh) over GQA
    keys and values (B, K, S, Dh) where the boolean mask is True, the logits soft-capped (float32
    softmax); returns the output (B, T, H, Dh) and the probabilities (B, H, T, S)."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    logits = soft_cap((q @ keys.transpose(-1, -2)).float() * scaling, softcap)
    probs = torch.softmax(logits.masked_fill(~mask_Bx1xTxS, float('-inf')), dim=-1)
    return (probs.to(values.dtype) @ values).transpose(1, 2), probs


# The field of transformers' model outputs that holds the cache: `cache` from 5.24 on, `past_key_values` before.
CACHE_FIELD = 'cache' if 'cache' in CausalLMOutputWithPast.__dataclass_fields__ else 'past_key_values'


class KeysOnlyLayer(DynamicLayer):
    """A cache entry that keeps keys; its values stay zero-width (B, K, S, 0): no bytes, and every
    DynamicLayer method (crop, reorder, batch select) still applies."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states, value_states[..., :0], *args, **kwargs)


class OwnHeadsLayer(DynamicLayer):
    """A cache entry that keeps keys and a layer's own value heads, the first `value_heads` of K
    (SkipV1Former's layers >= 2 read the rest from layer 1's entry)."""

    def __init__(self, value_heads: int):
        super().__init__()
        self.value_heads = value_heads

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states, value_states[:, : self.value_heads], *args, **kwargs)


class NothingLayer(DynamicLayer):
    """A cache entry that keeps neither: keys and values zero-width (B, K, S, 0), so it holds no
    bytes yet still counts the positions seen, and every DynamicLayer method still applies."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states[..., :0], value_states[..., :0], *args, **kwargs)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0


def cache_entry(config: VrlConfig, layer: int) -> DynamicLayer:
    """An empty cache entry for 0-based `layer`: keys and values (DynamicLayer), keys and its own value
    heads, keys only, or nothing (CLA's borrowing layers)."""
    if config.value_owner(layer) == layer:
        heads = config.own_value_heads(layer)
        return DynamicLayer() if heads == config.num_key_value_heads else OwnHeadsLayer(heads)
    return KeysOnlyLayer() if config.key_owner(layer) == layer else NothingLayer()


def _kind(entry: DynamicLayer) -> tuple:
    return type(entry), getattr(entry, 'value_heads', None)


def shape_cache(cache: DynamicCache, config: VrlConfig) -> DynamicCache:
    """Gives an empty cache `cache_entry`'s entries (transformers builds every entry as a DynamicLayer)."""
    entries = [cache_entry(config, layer) for layer in range(config.num_hidden_layers)]
    if cache.get_seq_length() == 0 and list(map(_kind, cache.layers)) != list(map(_kind, entries)):
        cache.layers[:] = entries
        cache.layer_class_to_replicate = None
    return cache


class VrlRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rope(x_BxNxTxDh: torch.Tensor, positions_BxT: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, in float32."""
    half = x_BxNxTxDh.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x_BxNxTxDh.device) / half)
    angles_Bx1xTxHalf = (positions_BxT.float()[..., None] * inv_freq)[:, None]
    sin, cos = angles_Bx1xTxHalf.sin(), angles_Bx1xTxHalf.cos()
    x1, x2 = x_BxNxTxDh.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BxNxTxDh.dtype)


class ValueLambdas(nn.Module):
    """ResFormer's scalar (lambda_1, lambda_2) of layers 2..L (N = L - 1 entries), per lambda_mode:
    identity 0.5 / 0.5; constant lambda1 / lambda2; sparse: those on sparse_layers, 0 / 1 elsewhere;
    learnable: parameters v1, vn (N,); learnable_plus: vn (N,) and lambda_1 = s softmax(w)."""

    def __init__(self, config: VrlConfig):
        super().__init__()
        N, mode = config.num_hidden_layers - 1, config.lambda_mode
        self.mode = mode
        if mode == 'learnable':
            self.v1, self.vn = nn.Parameter(torch.full((N,), 0.5)), nn.Parameter(torch.full((N,), 0.5))
        elif mode == 'learnable_plus':
            self.vn, self.w = nn.Parameter(torch.full((N,), 0.5)), nn.Parameter(torch.zeros(N))
            self.s = nn.Parameter(torch.tensor(float(config.num_hidden_layers)))
        elif mode == 'sparse':
            chosen = [layer + 2 in config.sparse_layers for layer in range(N)]
            self.fixed = (
                [config.lambda1 if c else 0.0 for c in chosen],
                [config.lambda2 if c else 1.0 for c in chosen],
            )
        else:
            v1, vn = (0.5, 0.5) if mode == 'identity' else (config.lambda1, config.lambda2)
            self.fixed = ([v1] * N, [vn] * N)

    def forward(self, layer: int) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(lambda_1, lambda_2) of 0-based `layer` >= 1."""
        if self.mode == 'learnable':
            return self.v1[layer - 1], self.vn[layer - 1]
        if self.mode == 'learnable_plus':
            return self.s * torch.softmax(self.w, dim=0)[layer - 1], self.vn[layer - 1]
        return self.fixed[0][layer - 1], self.fixed[1][layer - 1]


class VrlAttention(nn.Module):
    def __init__(self, config: VrlConfig, layer: int):
        super().__init__()
        D, H, K, Dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer, self.config = layer, config
        self.heads, self.kv_heads, self.head_dim = H, K, Dh
        # what transformers' attention functions (and vLLM's, under --model-impl transformers) read
        self.layer_idx, self.num_key_value_groups, self.is_causal = layer, H // K, True
        self.scaling = Dh**-0.5
        local = config.layer_types[layer] == 'sliding_attention'
        self.sliding_window = config.sliding_window if local else None
        owns_kv = config.key_owner(layer) == layer
        self.q_proj = nn.Linear(D, H * Dh, bias=False)
        self.k_proj = nn.Linear(D, K * Dh, bias=False) if owns_kv else None
        self.v_proj = (
            nn.Linear(D, config.own_value_heads(layer) * Dh, bias=False)
            if owns_kv and (layer == 0 or config.attention != 'svformer')
            else None
        )
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        # QK-norm: each head's queries and keys RMS-normalised over head_dim with a learned scale, before RoPE
        self.q_norm = VrlRMSNorm(Dh, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = VrlRMSNorm(Dh, config.rms_norm_eps) if config.qk_norm and owns_kv else None
        per_token = layer > 0 and config.attention == 'resformer' and config.lambda_mode == 'per_token'
        self.mix_proj = nn.Linear(D, K, bias=False) if per_token else None
        has_value_embed = config.value_embed_table(layer) is not None
        self.value_embed_gate = nn.Linear(D, K, bias=False) if has_value_embed else None

    def heads_major(self, x_BxTxND: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BxTxND.shape
        return x_BxTxND.view(B, T, -1, self.head_dim).transpose(1, 2)

    def gate(self, proj: nn.Linear, x_BxTxD: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W) per token and kv head, (B, K, T, 1), in float32."""
        return torch.sigmoid(proj(x_BxTxD).float()).transpose(1, 2)[..., None]

    def values_of(self, xv_BxTxD, v_n, v1, lambdas, value_embed_BxTxKDh) -> tuple[torch.Tensor, torch.Tensor]:
        """V_n (with its value embedding) and the values (B, K, T, Dh) this layer attends over; the gates
        read the values' input xv. SkipV1Former's V_n has only its own heads (B, K - skip_v1, T, Dh): the
        variant acts on those, and V_1's last heads follow as layer 1 attended them."""
        if value_embed_BxTxKDh is not None:
            scale = VALUE_EMBED_GATE_SCALE * self.gate(self.value_embed_gate, xv_BxTxD)
            v_n = v_n + (scale * self.heads_major(value_embed_BxTxKDh)).to(v_n.dtype)
        own = v_n.shape[1]
        v = self.attended(xv_BxTxD, v_n, None if v1 is None else v1[:, :own], lambdas)
        return v_n, v if own == self.kv_heads else torch.cat([v, v1[:, own:].to(v.dtype)], dim=1)

    def attended(self, xv_BxTxD, v_n, v1, lambdas) -> torch.Tensor:
        """The values attended in the heads this layer projects: V_n, V_1 (SVFormer) or ResFormer's mix."""
        if v1 is None or self.config.attention == 'vanilla':
            return v_n
        if self.config.attention == 'svformer':
            return v1
        if self.mix_proj is not None:
            mix = self.gate(self.mix_proj, xv_BxTxD)
            return (mix * v1 + (1 - mix) * v_n).to(v_n.dtype)
        lambda_v1, lambda_vn = lambdas
        return lambda_vn * v_n + lambda_v1 * v1

    def forward(
        self,
        x_BxTxD,
        xk_BxTxD,
        xv_BxTxD,
        positions_BxT,
        mask_Bx1xTxS,
        v1,
        borrowed,
        lambdas,
        value_embed_BxTxKDh,
        cache,
    ):
        """The attention output (B, T, D) and (keys, V_n, attended values) of the T new tokens, whose
        queries, keys and values read x, xk and xv (the same but for MUDD's k and v ways)."""
        theta = self.config.rope_theta
        q = self.heads_major(self.q_proj(x_BxTxD))
        q = rope(q if self.q_norm is None else self.q_norm(q), positions_BxT, theta)
        if self.k_proj is not None:
            k = self.heads_major(self.k_proj(xk_BxTxD))
            k = rope(k if self.k_norm is None else self.k_norm(k), positions_BxT, theta)
            v_n = v1 if self.v_proj is None else self.heads_major(self.v_proj(xv_BxTxD))
        else:  # CLA: the group's first layer's keys and attended values
            k, v_n = borrowed
        v_n, v = self.values_of(xv_BxTxD, v_n, v1, lambdas, value_embed_BxTxKDh)
        keys, values = k, v
        if cache is not None:
            cache.update(k, v, self.layer)  # each entry keeps what its kind holds (shape_cache)
            keys = cache.layers[self.config.key_owner(self.layer)].keys
            values = cache.layers[self.config.value_owner(self.layer)].values
            if values.shape[1] < self.kv_heads:  # SkipV1Former: the rest of the heads are V_1's
                values = torch.cat([values, cache.layers[0].values[:, values.shape[1] :]], dim=1)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        o, _ = attention(  # (B, T, H, Dh); vLLM's (B * T, H * Dh)
            self,
            q,
            keys,
            values,
            mask_Bx1xTxS,
            dropout=0.0,
            scaling=self.scaling,
            softcap=self.config.attn_logit_softcapping,
            sliding_window=self.sliding_window,
        )
        B, T, _ = x_BxTxD.shape
        o_BxTxHxDh = o.reshape(B, T, self.heads, self.head_dim)
        if self.config.neutreno and v1 is not None:  # NeuTRENO: + lambda (V_1 - attended V), per query head
            delta_BxHxTxDh = (v1 - v).repeat_interleave(self.num_key_value_groups, dim=1)
            o_BxTxHxDh = o_BxTxHxDh + self.config.neutreno_lambda * delta_BxHxTxDh.transpose(1, 2)
        return self.o_proj(o_BxTxHxDh.reshape(B, T, -1)), (k, v_n, v)


class VrlMLP(nn.Module):
    def __init__(self, config: VrlConfig):
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(D, F_, bias=False), nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MuddConnection(nn.Module):
    """MUDD after 0-based `layer`: each way c (config.mudd_after) is sum_j w_cj B_j over B_0 (the embedding)
    .. B_{layer+1}, w = GELU(RMSNorm(B_{layer+1}) W_in) W_out + static per position (RMSNorm without a scale,
    exact GELU; the norm, GELU and weights in float32, the projections in the model's dtype)."""

    def __init__(self, config: VrlConfig, layer: int):
        super().__init__()
        self.ways, inputs, hidden = config.mudd_after(layer), layer + 2, config.mudd_hidden(layer)
        self.proj_in = nn.Linear(config.hidden_size, hidden, bias=False)
        self.proj_out = nn.Linear(hidden, len(self.ways) * inputs, bias=False)
        self.static = nn.Parameter(torch.eye(inputs)[-1:].repeat(len(self.ways), 1))  # all on the newest output
        self.eps = config.rms_norm_eps

    def forward(self, blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each way's mix (..., D) of the outputs so far, each (..., D), by its letter."""
        dtype, newest = blocks[-1].dtype, blocks[-1].float()
        x = (newest * torch.rsqrt(newest.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        hidden = F.gelu(self.proj_in(x).float()).to(dtype)  # the projections called (vLLM replaces them)
        weights = self.proj_out(hidden).float().unflatten(-1, self.static.shape) + self.static.float()
        stacked = torch.stack(blocks, -1)  # (..., D, inputs)
        return {way: (stacked @ weights[..., c, :, None].to(dtype))[..., 0] for c, way in enumerate(self.ways)}


def sinkhorn(logits: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """A doubly stochastic matrix [destination, source] over the last two axes: exp, then columns and
    rows scaled to 1 in turn (the mHC paper's Eq. 9: each destination's weights sum to 1 exactly)."""
    m = torch.exp(logits - logits.amax((-2, -1), keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection (vrl/model/residual/hyper.py) over n streams h (n, ..., D): the sublayer's
    input sum_i pre_i h_i, and after it h'_j = sum_i res[j, i] h_i + post_j output. hc: learned constants
    plus gated tanh(norm(h_i) w) per stream, w (D, n + 2) = [pre, remix row, post]; mhc: the streams
    normalised together, w (n, D, 2n + n^2) = [pre, post, remix] logits times gates plus biases, then
    sigmoid, 2 sigmoid and Sinkhorn. The weights in float32."""

    def __init__(self, config: VrlConfig, layer: int, sublayer: int):
        super().__init__()
        n, D, hc = config.hyper_streams, config.hidden_size, config.hyper_connections == 'hc'
        self.kind, self.eps = config.hyper_connections, config.rms_norm_eps
        self.static_pre = nn.Parameter(torch.eye(n)[(2 * layer + sublayer) % n] if hc else torch.zeros(n))
        self.static_post = nn.Parameter(torch.ones(n) if hc else torch.zeros(n))
        self.static_res = nn.Parameter(torch.eye(n) if hc else torch.zeros(n, n))
        dynamic = config.hyper_dynamic
        self.norm = nn.Parameter(torch.ones(D) if hc else torch.ones(n, D)) if dynamic else None
        self.w = nn.Parameter(torch.zeros(D, n + 2) if hc else torch.zeros(n, D, 2 * n + n * n)) if dynamic else None
        self.gates = nn.Parameter(torch.full((2 if hc else 3,), 0.01)) if dynamic else None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The sublayer's input (..., D) and the weights `add` takes: post (..., n), res (..., n, n)."""
        x, n = h.float(), h.shape[0]
        pre, post, res = (
            p.float().expand(*h.shape[1:-1], *p.shape) for p in (self.static_pre, self.static_post, self.static_res)
        )
        if self.w is not None:
            gates = self.gates.float()
            if self.kind == 'hc':  # each stream's own [pre, remix row, post]
                normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.float()
                d = torch.tanh(normed @ self.w.float()).movedim(0, -2)  # (..., n streams, n + 2)
                pre = pre + gates[0] * d[..., 0]
                res = res + gates[0] * d[..., 1 : n + 1].transpose(-1, -2)
                post = post + gates[1] * d[..., n + 1]
            else:  # all streams together
                scale = self.norm.float().reshape(n, *[1] * (h.ndim - 2), -1)
                normed = x * torch.rsqrt(x.pow(2).mean((0, -1), keepdim=True) + self.eps) * scale
                d = torch.einsum('n...d,ndk->...k', normed, self.w.float())
                pre = pre + gates[0] * d[..., :n]
                post = post + gates[1] * d[..., n : 2 * n]
                res = res + gates[2] * d[..., 2 * n :].unflatten(-1, (n, n))
        if self.kind == 'mhc':
            pre, post, res = torch.sigmoid(pre), 2 * torch.sigmoid(post), sinkhorn(res)
        return torch.einsum('...n,n...d->...d', pre, x).to(h.dtype), (post, res)

    @staticmethod
    def add(weights: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The streams (n, ..., D) after the sublayer's output (..., D) is added with `forward`'s weights."""
        post, res = weights
        remixed = torch.einsum('...ji,i...d->j...d', res, h.float())
        return (remixed + post.movedim(-1, 0)[..., None] * out.float()).to(h.dtype)


class DepthStream(NamedTuple):
    """Attention residuals' stream: the sources so far (the embedding output, then each completed one)
    and the partial sum of the sublayer outputs since the last, None when none has begun."""

    sources: list
    partial: torch.Tensor | None

    def after(self, out: torch.Tensor, completes: bool) -> DepthStream:
        partial = out if self.partial is None else self.partial + out
        return DepthStream([*self.sources, partial], None) if completes else DepthStream(self.sources, partial)


class DepthQuery(nn.Module):
    """Attention residuals (vrl/model/residual/attnres.py): one sublayer's pseudo-query over depth and its key
    norm's scale (layer None: the output query after the last layer). Its input is softmax_j(w . RMSNorm(v_j))
    over the sources (and the partial sum), in float32; `completes`: whether the partial sum becomes a
    source after this sublayer ('full': every one; 'block': a block's last MLP)."""

    def __init__(self, config: VrlConfig, layer: int | None = None, sublayer: int = 0):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        self.key_scale = nn.Parameter(torch.ones(config.hidden_size))
        self.eps = config.rms_norm_eps
        per_block = config.num_hidden_layers // config.attn_residual_blocks
        full = config.attn_residuals == 'full'
        self.completes = layer is not None and (full or (sublayer == 1 and (layer + 1) % per_block == 0))

    def forward(self, stream: DepthStream) -> torch.Tensor:
        V = torch.stack([*stream.sources, *([] if stream.partial is None else [stream.partial])]).float()
        keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + self.eps) * self.key_scale.float()
        alpha = torch.softmax(keys @ self.query.float(), dim=0)
        return torch.einsum('s...,s...d->...d', alpha, V).to(stream.sources[0].dtype)


def enter(connection: HyperConnection | DepthQuery | None, h) -> tuple[torch.Tensor, tuple | DepthQuery | None]:
    """A sublayer's input before its norm and what `add` takes to add its output: h itself and None without
    a connection; hyper-connections' weighted sum and weights; attention residuals' mix and query."""
    if isinstance(connection, DepthQuery):
        return connection(h), connection
    return (h, None) if connection is None else connection(h)


def connections(layer: nn.Module) -> tuple:
    """What a decoder layer's attention and MLP enter through: its hyper-connections, its attention
    residuals' queries, or None (this file's layers and vLLM's)."""
    return (layer.attn_hyper, layer.mlp_hyper) if layer.attn_depth is None else (layer.attn_depth, layer.mlp_depth)


def add(weights: tuple | DepthQuery | None, h, out: torch.Tensor):
    if isinstance(weights, DepthQuery):
        return h.after(out, weights.completes)
    return h + out if weights is None else HyperConnection.add(weights, h, out)


class VrlDecoderLayer(nn.Module):
    def __init__(self, config: VrlConfig, layer: int):
        super().__init__()
        self.input_layernorm = VrlRMSNorm(config.hidden_size, config.rms_norm_eps)  # of the query input
        mixed = config.mudd[:-1] if layer > 0 else ''  # MUDD's k and v ways: their own norms
        self.k_input_norm = VrlRMSNorm(config.hidden_size, config.rms_norm_eps) if 'k' in mixed else None
        self.v_input_norm = VrlRMSNorm(config.hidden_size, config.rms_norm_eps) if 'v' in mixed else None
        self.self_attn = VrlAttention(config, layer)
        self.post_attention_layernorm = VrlRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = VrlMLP(config)
        # DenseFormer: the next block's input is sum_j w_j B_j over B_0 (the embedding) .. B_{layer+1}
        identity = torch.zeros(layer + 2)
        identity[-1] = 1.0
        self.depth_weights = nn.Parameter(identity) if config.denseformer else None
        self.mudd = MuddConnection(config, layer) if config.mudd_after(layer) else None
        connected = bool(config.hyper_connections)
        self.attn_hyper = HyperConnection(config, layer, 0) if connected else None
        self.mlp_hyper = HyperConnection(config, layer, 1) if connected else None
        over_depth = bool(config.attn_residuals)
        self.attn_depth = DepthQuery(config, layer, 0) if over_depth else None
        self.mlp_depth = DepthQuery(config, layer, 1) if over_depth else None

    def forward(self, h, ways, *attention_inputs):
        """h: (B, T, D), hyper-connections' streams (n, B, T, D) or attention residuals' DepthStream; ways:
        MUDD's mixed q, k, v inputs by letter (absent: h)."""
        into_attention_by, into_mlp_by = connections(self)
        x, into_attention = enter(into_attention_by, h)
        x = self.input_layernorm(ways.get('q', x))
        norms = (self.k_input_norm, self.v_input_norm)
        xk, xv = (x if norm is None else norm(ways.get(w, h)) for w, norm in zip('kv', norms))
        out, kv = self.self_attn(x, xk, xv, *attention_inputs)
        h = add(into_attention, h, out)
        x, into_mlp = enter(into_mlp_by, h)
        return add(into_mlp, h, self.mlp(self.post_attention_layernorm(x))), kv


class VrlPreTrainedModel(PreTrainedModel):
    config_class = VrlConfig
    base_model_prefix = 'model'
    _no_split_modules = ['VrlDecoderLayer']
    _skip_keys_device_placement = ['cache', 'past_key_values']
    _supports_attention_backend = True  # attention goes through transformers' interface (VrlAttention.forward)

    @property
    def _supports_sdpa(self) -> bool:
        """PyTorch's fused attention (transformers' default) has no soft cap: a capped model runs eagerly."""
        return not self.config.attn_logit_softcapping

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)


class PlainStream:
    """How the layers connect (vrl/model/residual/'s hooks, as the export runs them), the standard residual
    stream here: `begin` (the stream from the embedding output), `after_layer` (what a layer hands the
    next: the stream and MUDD's q, k, v inputs by letter) and `readout` (the final norm's input). A
    sublayer's input and the add after it are `enter` and `add`, which the decoder layers call."""

    def __init__(self, model: nn.Module):
        self.model, self.blocks = model, []

    def begin(self, h: torch.Tensor):
        return h

    def after_layer(self, block: nn.Module, h) -> tuple:
        return h, {}

    def readout(self, h) -> torch.Tensor:
        return h


class DenseStream(PlainStream):
    """DenseFormer: each block's input the block's static average of B_0 (the embedding) .. B_{layer+1}."""

    def begin(self, h: torch.Tensor) -> torch.Tensor:
        self.blocks = [h]
        return h

    def after_layer(self, block: nn.Module, h: torch.Tensor) -> tuple:
        self.blocks.append(h)
        return torch.einsum('j,j...->...', block.depth_weights.to(h.dtype), torch.stack(self.blocks)), {}


class MuddStream(DenseStream):
    """MUDD: after a layer with a connection, each way its own mix of the outputs so far (r: the stream)."""

    def after_layer(self, block: nn.Module, h: torch.Tensor) -> tuple:
        self.blocks.append(h)
        ways = {} if block.mudd is None else block.mudd(self.blocks)
        return ways.pop('r', h), ways


class HyperStream(PlainStream):
    """Hyper-connections: n streams (n, ..., D), the embedding output in each; their sum is read out."""

    def begin(self, h: torch.Tensor) -> torch.Tensor:
        return h.expand(self.model.config.hyper_streams, *h.shape)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        return h.sum(0)


class AttnResStream(PlainStream):
    """Attention residuals: the embedding output the first source; the output query mixes them all."""

    def begin(self, h: torch.Tensor) -> DepthStream:
        return DepthStream([h], None)

    def readout(self, h: DepthStream) -> torch.Tensor:
        return self.model.depth_output(h)


STREAMS = {
    'plain': PlainStream,
    'dense': DenseStream,
    'mudd': MuddStream,
    'hc': HyperStream,
    'mhc': HyperStream,
    'attnres': AttnResStream,
}


def layer_loop(model: nn.Module, h: torch.Tensor, input_ids: torch.Tensor, run: Callable) -> torch.Tensor:
    """The decoder's layers over the embedding output h, final-normalised: this VrlModel's and vLLM's
    (serving/vllm), which differ only in how a layer attends. Per layer: ResFormer's lambdas, the value
    embedding, V_1 and CLA's borrowed keys and values from the layers before; between layers, what the
    config's connection (STREAMS) hands on. `run(layer, block, h, ways, v1, borrowed, lambdas, value_embed)`
    calls one VrlDecoderLayer with the caller's positions, masks and cache, and returns (h, (k, V_n, V))."""
    config = model.config
    stream = STREAMS[config.residual](model)
    h, ways = stream.begin(h), {}
    v1 = borrowed = None
    for layer, block in enumerate(model.layers):
        lambdas = model.value_lambdas(layer) if model.value_lambdas is not None and layer > 0 else None
        table = config.value_embed_table(layer)
        value_embed = None if table is None else model.value_embeds[table](input_ids)
        h, (k, v_n, v) = run(layer, block, h, ways, v1, borrowed, lambdas, value_embed)
        v1 = v if v1 is None else v1
        borrowed = (k, v)
        h, ways = stream.after_layer(block, h)
    return model.norm(stream.readout(h))


class VrlModel(VrlPreTrainedModel):
    def __init__(self, config: VrlConfig):
        super().__init__(config)
        K, Dh = config.num_key_value_heads, config.head_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(VrlDecoderLayer(config, layer) for layer in range(config.num_hidden_layers))
        self.norm = VrlRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.depth_output = DepthQuery(config) if config.attn_residuals else None
        scalar_lambdas = config.attention == 'resformer' and config.lambda_mode != 'per_token'
        self.value_lambdas = ValueLambdas(config) if scalar_lambdas else None
        tables = set(config.value_embed_tables or range(len(config.value_embed_layers)))
        self.value_embeds = nn.ModuleList(nn.Embedding(config.vocab_size, K * Dh) for _ in tables) if tables else None
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DynamicCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, DynamicCache | None]:
        """Final-normalised hidden states (B, T, D) of T new tokens after the cached ones, and the cache.

        attention_mask (B, S), 1 for real tokens, 0 for padding; positions then count real tokens.
        inputs_embeds (B, T, D) may stand in for input_ids (B, T), except where value embeddings
        look the ids up.
        """
        if input_ids is None and self.value_embeds is not None:
            raise ValueError(
                'a model with value embeddings takes input_ids (its tables look them up), not inputs_embeds'
            )
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None:
            cache = shape_cache(cache, self.config)
        B, T, _ = h.shape
        past = cache.get_seq_length() if cache is not None else 0
        S = past + T
        real_BxS = (
            torch.ones(B, S, dtype=torch.bool, device=h.device) if attention_mask is None else attention_mask.bool()
        )
        if position_ids is None:
            position_ids = (real_BxS.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        query_T, key_S = torch.arange(past, S, device=h.device), torch.arange(S, device=h.device)
        causal_TxS = key_S[None, :] <= query_T[:, None]
        own_TxS = key_S[None, :] == query_T[:, None]  # a padding query sees itself: no empty softmax row
        mask_Bx1xTxS = (causal_TxS & (real_BxS[:, None, :] | own_TxS))[:, None]
        masks = {'full_attention': mask_Bx1xTxS}
        if self.config.sliding_window:  # a local layer's query sees the window up to itself
            near_TxS = query_T[:, None] - key_S[None, :] < self.config.sliding_window
            masks['sliding_attention'] = mask_Bx1xTxS & near_TxS

        def run(layer, block, h, ways, *values):
            mask = masks[self.config.layer_types[layer]]
            return block(h, ways, position_ids, mask, *values, cache)

        return layer_loop(self, h, input_ids, run), cache


class VrlForCausalLM(VrlPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {'lm_head.weight': 'model.embed_tokens.weight'}

    def __init__(self, config: VrlConfig):
        super().__init__(config)
        self.model = VrlModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DynamicCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        past_key_values: DynamicCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`cache` and `past_key_values` are one argument under its new and its old name: give either."""
        if cache is not None and past_key_values is not None:
            raise ValueError('give the cache as `cache` or as `past_key_values`, not both')
        h, cache = self.model(
            input_ids, attention_mask, position_ids, past_key_values if cache is None else cache, use_cache
        )
        logits = soft_cap(
            self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h).float(), self.config.final_logit_softcapping
        )
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
