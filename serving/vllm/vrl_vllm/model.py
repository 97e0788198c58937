"""vrl's decoder family in vLLM: the `VrlForCausalLM` that `python -m vrl.tools.export` writes, on
vLLM's layers (tensor-parallel linears, paged attention, its RoPE, RMSNorm and logits processor).

The same decoder as the export's modeling_vrl.py, whose config class (VrlConfig: which layer owns
which keys and values, which value-embedding table a layer adds), ResFormer lambdas (ValueLambdas),
MUDD's connections (MuddConnection), hyper-connections (HyperConnection, enter, add), attention
residuals (DepthQuery), value-embedding
gate scale and loop over the layers (layer_loop) this file takes from the exported directory, so the
two cannot drift apart. Each variant changes one thing, all of it in `VrlAttention`,
`VrlDecoderLayer.forward` and the export's `layer_loop`:

- the values a layer attends over: ResFormer lambda_2 V_n + lambda_1 V_1 (scalars per layer, or per
  token and kv head: mix_proj), SVFormer's layers >= 2 V_1, SkipV1Former's layers >= 2 their own heads
  and V_1's last skip_v1, value embeddings + 2 sigmoid(x W) table[token];
- CLA: a layer that borrows its group's keys and values reads the owner's cache
  (vLLM's `kv_sharing_target_layer_name`) and writes none;
- NeuTRENO: + lambda (V_1 - the values attended) on the attention output;
- DenseFormer: the next block's input is the depth-weighted sum of the embedding and every block output;
- MUDD: the next block's residual (and, per its ways, query, key and value inputs) are each a per-token
  weighted sum of the embedding and every block output;
- hyper-connections: the residual stream is n streams (n, T, D); each sublayer reads their weighted sum
  and adds its output to their remix;
- attention residuals: each sublayer reads a softmax over the sources before it (the embedding output
  and the earlier outputs, or blocks of them), and the final norm the output query's.

What the cache holds: vLLM gives every attention layer that owns its keys a paged cache of keys
and values, and CLA's borrowing layers none. SVFormer's and SkipV1Former's layers attend in head groups
whose keys and values are paged apart, so that V_1's heads are stored once (shared_values.py): (L + 1) / (2 L)
and 1 - (L - 1) skip_v1 / (2 K L) of vanilla's bytes, as in vrl's own decoding.

Shapes: T tokens of the batch laid end to end (vLLM's layout), D hidden, H heads, K kv heads and
Dh head dim, H and K per tensor-parallel rank; per-head tensors flat, (T, K * Dh).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader

from vrl_vllm.shared_values import SharedValueAttention, attend_in_groups, head_group, values_page


def exported(name: str, vllm_config: VllmConfig) -> Any:
    """`name` from the export's modeling_vrl.py (a class or a constant), loaded as transformers loads it."""
    return get_class_from_dynamic_module(f'modeling_vrl.{name}', vllm_config.model_config.model)


def layer_prefix(prefix: str, layer: int) -> str:
    return f'{prefix}.layers.{layer}'


class KvHeadColumns(nn.Module):
    """A (rows, K * Dh) table whose columns are split by kv head across tensor-parallel ranks, as
    the keys and values are: a value-embedding table (rows = vocabulary)."""

    def __init__(self, rows: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.width = kv_heads * head_dim  # this rank's columns
        self.weight = nn.Parameter(torch.empty(rows, self.width), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        start = get_tensor_model_parallel_rank() * self.width
        param.data.copy_(loaded[:, start : start + self.width])

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids_T, self.weight)


def linear(vllm_config: VllmConfig, d_in: int, d_out: int, prefix: str) -> ColumnParallelLinear:
    """A bias-free projection whose outputs (heads, kv heads, or d_ff) are split across ranks."""
    return ColumnParallelLinear(d_in, d_out, bias=False, quant_config=vllm_config.quant_config, prefix=prefix)


class VrlAttention(nn.Module):
    def __init__(self, vllm_config: VllmConfig, layer: int, prefix: str, model_prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        D, H, K, Dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        tp = get_tensor_model_parallel_world_size()
        if H % tp or K % tp:
            raise ValueError(
                f'vrl models split whole heads across ranks: tensor_parallel_size {tp} must divide '
                f'num_attention_heads {H} and num_key_value_heads {K}'
            )
        self.config, self.layer = config, layer
        self.heads, self.kv_heads, self.head_dim = H // tp, K // tp, Dh
        owns_kv = config.key_owner(layer) == layer
        self.q_proj = linear(vllm_config, D, H * Dh, f'{prefix}.q_proj')
        self.k_proj = linear(vllm_config, D, K * Dh, f'{prefix}.k_proj') if owns_kv else None
        has_v = owns_kv and (layer == 0 or config.attention != 'svformer')
        own_heads = K - (config.skip_v1 if layer > 0 else 0)  # SkipV1Former's later layers project K - skip_v1
        self.v_proj = linear(vllm_config, D, own_heads * Dh, f'{prefix}.v_proj') if has_v else None
        self.o_proj = RowParallelLinear(
            H * Dh, D, bias=False, quant_config=vllm_config.quant_config, prefix=f'{prefix}.o_proj'
        )
        self.q_norm = RMSNorm(Dh, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(Dh, eps=config.rms_norm_eps) if config.qk_norm and owns_kv else None
        per_token = layer > 0 and config.attention == 'resformer' and config.lambda_mode == 'per_token'
        self.mix_proj = linear(vllm_config, D, K, f'{prefix}.mix_proj') if per_token else None
        has_value_embed = config.value_embed_table(layer) is not None
        self.value_embed_gate = linear(vllm_config, D, K, f'{prefix}.value_embed_gate') if has_value_embed else None
        self.value_embed_gate_scale = exported('VALUE_EMBED_GATE_SCALE', vllm_config) if has_value_embed else None
        self.rotary_emb = get_rope(
            Dh,
            max_position=config.max_position_embeddings,
            is_neox_style=True,  # rotate-half
            rope_parameters={'rope_type': 'default', 'rope_theta': config.rope_theta},
        )
        local = config.layer_types[layer] == 'sliding_attention'
        owner = config.key_owner(layer)
        cache = dict(
            num_kv_heads=self.kv_heads, cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config
        )
        attend = dict(
            logits_soft_cap=config.attn_logit_softcapping,
            per_layer_sliding_window=config.sliding_window if local else None,
        )
        target = None if owner == layer else f'{layer_prefix(model_prefix, owner)}.self_attn.attn'
        group = head_group(config, self.kv_heads)
        if group:  # V_1's heads stored once: a kernel call per head group on its keys and values pages
            self.values, self.attn = self.grouped_attention(layer, model_prefix, group, cache, attend, target)
        else:  # vLLM's own pages
            self.attn = Attention(
                self.heads,
                Dh,
                Dh**-0.5,
                **cache,
                **attend,
                kv_sharing_target_layer_name=target,
                prefix=f'{prefix}.attn',
            )

    def grouped_attention(
        self, layer: int, model_prefix: str, group: int, cache: dict, attend: dict, target: str | None
    ) -> tuple[nn.ModuleList, nn.ModuleList]:
        """SVFormer's and SkipV1Former's attention (shared_values.py): the values pages this layer makes (those of
        its own head groups, and layer 1's of V_1's) and a call per head group of `group` kv heads (CLA's borrowing
        layer: on its owner's pages, `target`)."""
        config, owner = self.config, self.config.key_owner(layer)
        if get_tensor_model_parallel_world_size() > 1 and config.skip_v1:
            raise ValueError('SkipV1Former in vLLM is served on one rank: tensor_parallel_size must be 1')
        pages = [values_page(config, layer, c, self.kv_heads) for c in range(self.kv_heads // group)]
        heads, Dh = group * (self.heads // self.kv_heads), self.head_dim

        def page_name(page: int, c: int) -> str:
            return f'{layer_prefix(model_prefix, page)}.self_attn.values_{c}'  # one integer in a name: the layer's

        def call(**names) -> SharedValueAttention:
            return SharedValueAttention(heads, Dh, Dh**-0.5, **{**cache, 'num_kv_heads': group}, **names)

        made = nn.ModuleList(  # pages that are never called: their keys page holds the values
            call(values_name=page_name(layer, c), prefix=page_name(layer, c))
            for c, page in enumerate(pages)
            if page == layer == owner
        )
        calls = nn.ModuleList(
            call(
                **attend,
                values_name=page_name(page, c),
                kv_sharing_target_layer_name=None if target is None else f'{target}_{c}',
                prefix=f'{layer_prefix(model_prefix, layer)}.self_attn.attn_{c}',
            )
            for c, page in enumerate(pages)
        )
        return made, calls

    def per_head(self, norm: RMSNorm | None, x_TxNDh: torch.Tensor) -> torch.Tensor:
        """QK-norm: each head's vector RMS-normalised over Dh with a learned scale (x itself without)."""
        if norm is None:
            return x_TxNDh
        T = x_TxNDh.shape[0]
        return norm(x_TxNDh.view(T, -1, self.head_dim)).view(T, -1)

    def gate(self, proj: ColumnParallelLinear, x_TxD: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W) per token and kv head, (T, K, 1), in float32."""
        return torch.sigmoid(proj(x_TxD)[0].float())[..., None]

    def gated(self, gate_TxKx1: torch.Tensor, v_TxKDh: torch.Tensor) -> torch.Tensor:
        T = v_TxKDh.shape[0]
        return (gate_TxKx1 * v_TxKDh.view(T, self.kv_heads, self.head_dim)).view(T, -1).to(v_TxKDh.dtype)

    def values_of(self, xv_TxD, v_n, v1, lambdas, value_embed_TxKDh) -> tuple[torch.Tensor, torch.Tensor]:
        """V_n (with its value embedding) and the values (T, K * Dh) this layer attends over; the gates read
        the values' input xv. SkipV1Former's V_n has its own heads only: the variant acts on those, and V_1's
        last heads follow."""
        if value_embed_TxKDh is not None:
            scale = self.value_embed_gate_scale * self.gate(self.value_embed_gate, xv_TxD)
            v_n = v_n + self.gated(scale, value_embed_TxKDh)
        own = v_n.shape[-1]
        v = self.attended(xv_TxD, v_n, None if v1 is None else v1[:, :own], lambdas)
        return v_n, v if v1 is None or own == v1.shape[-1] else torch.cat([v, v1[:, own:]], dim=-1)

    def attended(self, xv_TxD, v_n, v1, lambdas) -> torch.Tensor:
        """The values attended in the heads this layer projects: V_n, V_1 (SVFormer) or ResFormer's mix."""
        if v1 is None or self.config.attention == 'vanilla':
            return v_n
        if self.config.attention == 'svformer':
            return v1
        if self.mix_proj is not None:
            mix = self.gate(self.mix_proj, xv_TxD)
            return self.gated(mix, v1) + self.gated(1 - mix, v_n)
        lambda_v1, lambda_vn = lambdas
        return lambda_vn * v_n + lambda_v1 * v1

    def forward(self, positions_T, x_TxD, xk_TxD, xv_TxD, v1, borrowed, lambdas, value_embed_TxKDh):
        """The attention output (T, D) and (keys, V_n, attended values) of this layer, whose queries, keys
        and values read x, xk and xv (the same but for MUDD's k and v ways)."""
        q = self.per_head(self.q_norm, self.q_proj(x_TxD)[0])
        if self.k_proj is not None:
            k = self.per_head(self.k_norm, self.k_proj(xk_TxD)[0])
            q, k = self.rotary_emb(positions_T, q, k)
            v_n = v1 if self.v_proj is None else self.v_proj(xv_TxD)[0]
        else:  # CLA: the group's first layer's keys and attended values, read from its cache
            q, _ = self.rotary_emb(positions_T, q, None)
            k, v_n = borrowed
        v_n, v = self.values_of(xv_TxD, v_n, v1, lambdas, value_embed_TxKDh)
        o = self.attn(q, k, v) if isinstance(self.attn, Attention) else attend_in_groups(self.attn, q, k, v)
        if self.config.neutreno and v1 is not None:  # + lambda (V_1 - attended V), per query head
            T, groups = o.shape[0], self.heads // self.kv_heads
            delta = (v1 - v).view(T, self.kv_heads, 1, self.head_dim).expand(-1, -1, groups, -1)
            o = o + self.config.neutreno_lambda * delta.reshape(T, -1)
        return self.o_proj(o)[0], (k, v_n, v)


class VrlMLP(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj = linear(vllm_config, D, F_, f'{prefix}.gate_proj')
        self.up_proj = linear(vllm_config, D, F_, f'{prefix}.up_proj')
        self.down_proj = RowParallelLinear(
            F_, D, bias=False, quant_config=vllm_config.quant_config, prefix=f'{prefix}.down_proj'
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)[0]) * self.up_proj(x)[0])[0]


class VrlDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, layer: int, model_prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        prefix = layer_prefix(model_prefix, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # of the query input
        mixed = config.mudd[:-1] if layer > 0 else ''  # MUDD's k and v ways: their own norms
        self.k_input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if 'k' in mixed else None
        self.v_input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if 'v' in mixed else None
        self.self_attn = VrlAttention(vllm_config, layer, f'{prefix}.self_attn', model_prefix)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = VrlMLP(vllm_config, f'{prefix}.mlp')
        # DenseFormer: the next block's input is sum_j w_j B_j over B_0 (the embedding) .. B_{layer+1}
        self.depth_weights = nn.Parameter(torch.empty(layer + 2), requires_grad=False) if config.denseformer else None
        # MUDD: the next block's inputs, each a per-token mix of B_0 .. B_{layer+1} (small: every rank holds it)
        mudd = config.mudd_after(layer) and exported('MuddConnection', vllm_config)(config, layer)
        self.mudd = mudd.requires_grad_(False) if mudd else None
        # hyper-connections: each sublayer's weights of the n streams (small: every rank holds them)
        hyper = config.hyper_connections and exported('HyperConnection', vllm_config)
        self.attn_hyper, self.mlp_hyper = (
            hyper(config, layer, i).requires_grad_(False) if hyper else None for i in (0, 1)
        )
        # attention residuals: each sublayer's query over depth (small: every rank holds it)
        depth = config.attn_residuals and exported('DepthQuery', vllm_config)
        self.attn_depth, self.mlp_depth = (
            depth(config, layer, i).requires_grad_(False) if depth else None for i in (0, 1)
        )
        self.enter, self.add = exported('enter', vllm_config), exported('add', vllm_config)
        self.connections = exported('connections', vllm_config)

    def forward(self, positions_T, h, ways, *attention_inputs):
        """h: (T, D), hyper-connections' streams (n, T, D) or attention residuals' DepthStream; ways:
        MUDD's mixed q, k, v inputs by letter (absent: h)."""
        into_attention_by, into_mlp_by = self.connections(self)
        x, into_attention = self.enter(into_attention_by, h)
        x = self.input_layernorm(ways.get('q', x))
        norms = (self.k_input_norm, self.v_input_norm)
        xk, xv = (x if norm is None else norm(ways.get(w, h)) for w, norm in zip('kv', norms))
        out, kv = self.self_attn(positions_T, x, xk, xv, *attention_inputs)
        h = self.add(into_attention, h, out)
        x, into_mlp = self.enter(into_mlp_by, h)
        return self.add(into_mlp, h, self.mlp(self.post_attention_layernorm(x))), kv


class VrlModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ''):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            VrlDecoderLayer(vllm_config, layer, prefix) for layer in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        depth = config.attn_residuals and exported('DepthQuery', vllm_config)
        self.depth_output = depth(config).requires_grad_(False) if depth else None
        scalar_lambdas = config.attention == 'resformer' and config.lambda_mode != 'per_token'
        self.value_lambdas = exported('ValueLambdas', vllm_config)(config) if scalar_lambdas else None
        kv_heads = config.num_key_value_heads // get_tensor_model_parallel_world_size()
        tables = set(config.value_embed_tables or range(len(config.value_embed_layers)))
        self.value_embeds = nn.ModuleList(KvHeadColumns(config.vocab_size, kv_heads, config.head_dim) for _ in tables)
        self.layer_loop = exported('layer_loop', vllm_config)  # the export's loop over the layers

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """Final-normalised hidden states (T, D)."""
        h = self.embed_input_ids(input_ids_T)

        def run(layer, block, h, ways, *values):
            return block(positions_T, h, ways, *values)

        return self.layer_loop(self, h, input_ids_T, run)


class VrlForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ''):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError('vrl models are served without pipeline parallelism: pipeline_parallel_size must be 1')
        self.config = config
        self.model = VrlModel(vllm_config=vllm_config, prefix=f'{prefix}.model' if prefix else 'model')
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config)
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.final_logit_softcapping)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError('vrl models take token ids (value embeddings look them up), not inputs_embeds')
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)  # a tied head is loaded once, as the embedding
