"""SVFormer's and SkipV1Former's caches in vLLM: V_1's heads stored once, beside each layer's keys.

vLLM's page for a block holds one layer's keys and values. These models instead attend in groups of kv
heads (`head_group`: all of them for SVFormer; for SkipV1Former the largest group that splits a layer's
own heads from V_1's), each group one call of the backend's kernel on a keys-only page (a spec with
`head_size_v=0`) and a values page (`values_page`): the group's own values page, which its layer writes,
or V_1's, which layer 1 owns and every layer reads. SVFormer keeps per block a keys page for every layer
that owns keys and one page of V_1: (L + 1) / (2L) of vanilla's bytes. SkipV1Former keeps every key,
each later layer's own value heads and V_1 once: 1 - (L - 1) s / (2KL) with s of K heads V_1's (0.8125
at L = 4, half the heads). With CLA, a borrowing layer reads its owner's pages and stores nothing.

Every page holds one head group's keys or values, so all are the same size, full attention in one KV
cache group: block b of every page holds the same tokens, under one block table. A local layer's keys
are therefore kept for every token (as V_1 must be, for the global layers); its window applies when it
attends.

The backends' attention kernels take the key and value caches as two tensors with one set of strides
(the CPU kernel reads both with the key cache's), which a keys page and the values page share: each
layer's attention is the backend's own kernel on (its keys page, the values page). Backends: vLLM's CPU
attention (CPU_ATTN, tested), FlashAttention on GPUs (FLASH_ATTN; written to the same kernel interface,
not run here). Refused in one line: another backend, a quantised KV cache (V_1 is written by every layer
with that layer's scale), decode context parallelism and cascade attention on GPUs, and SkipV1Former on
several tensor-parallel ranks (each rank would hold pages of another kind).
"""

from __future__ import annotations

import math

import torch
from vllm import _custom_ops as ops
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.kv_cache_interface import FullAttentionSpec


def head_group(config, kv_heads: int) -> int:
    """The kv heads each kernel call attends with (of this rank's `kv_heads`): all of them for SVFormer, the
    largest group that keeps a SkipV1Former layer's own heads and V_1's apart, 0 for a model whose pages
    are vLLM's own (keys and values together)."""
    if config.attention == 'svformer':
        return kv_heads
    return math.gcd(kv_heads - config.skip_v1, config.skip_v1) if config.skip_v1 else 0


def values_page(config, layer: int, group: int, kv_heads: int) -> int:
    """The layer whose values page head group `group` of 0-based `layer` reads: layer 1 (0) for V_1's heads
    (all of SVFormer's, SkipV1Former's last skip_v1), else the first layer of its CLA group."""
    borrowed = config.attention == 'svformer' or group * head_group(config, kv_heads) >= kv_heads - config.skip_v1
    return 0 if borrowed else config.key_owner(layer)


def attend_in_groups(calls, q_TxHDh: torch.Tensor, k_TxKDh: torch.Tensor, v_TxKDh: torch.Tensor) -> torch.Tensor:
    """The attention output (T, H * Dh): each head group's call on its query heads, keys and values."""
    groups = len(calls)
    parts = zip(calls, q_TxHDh.chunk(groups, -1), k_TxKDh.chunk(groups, -1), v_TxKDh.chunk(groups, -1))
    return torch.cat([call(q.contiguous(), k.contiguous(), v.contiguous()) for call, q, k, v in parts], dim=-1)


def values_cache(layer: SharedValueAttention) -> torch.Tensor:
    """The values page's cache, (blocks, K, block_size, Dh) as vLLM laid it out."""
    return get_forward_context().no_compile_layers[layer.values_name].kv_cache


class CpuSharedValueImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention with the keys from the layer's page and the values from the values page."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """The layer's keys into its page; `value` (V_1, the same for every layer) into the values page."""
        ops.cpu_attn_reshape_and_cache(
            key, value, kv_cache, values_cache(layer), slot_mapping, layer.isa, kv_cache_dtype=self.kv_cache_dtype
        )

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if attn_metadata is None:  # vLLM's warm-up
            return output
        tokens = attn_metadata.num_actual_tokens
        ops.cpu_attention_with_kv_cache(
            query=query[:tokens],
            key_cache=kv_cache,
            value_cache=values_cache(layer),
            output=output[:tokens],
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            scale=self.scale,
            causal=attn_metadata.causal,
            alibi_slopes=None,
            sliding_window=self.sliding_window,
            block_table=attn_metadata.block_table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=attn_metadata.scheduler_metadata,
            s_aux=None,
            dynamic_causal=attn_metadata.dynamic_causal,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return output


class CpuSharedValueBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CpuSharedValueImpl]:
        return CpuSharedValueImpl


def flash_backend() -> type:
    """FlashAttention (GPUs) with the keys from the layer's page and the values from the values page."""
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionImpl,
        flash_attn_varlen_func,
        reshape_and_cache_flash,
    )

    class FlashSharedValueImpl(FlashAttentionImpl):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            # (blocks, K, block_size, Dh) -> (blocks, block_size, K, Dh), FlashAttention's order
            keys, values = kv_cache.transpose(1, 2), values_cache(layer).transpose(1, 2)
            reshape_and_cache_flash(key, value, keys, values, slot_mapping, 'auto', layer._k_scale, layer._v_scale)

        def forward(
            self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
        ):
            if attn_metadata is None:  # vLLM's profiling run
                return output.fill_(0)
            if self.dcp_world_size > 1 or getattr(attn_metadata, 'use_cascade', False):
                raise ValueError(
                    'SVFormer and SkipV1Former in vLLM attend without decode context parallelism or cascade attention: '
                    'serve with --decode-context-parallel-size 1 --disable-cascade-attn'
                )
            tokens = attn_metadata.num_actual_tokens
            window = None if self.sliding_window is None else list(self.sliding_window)
            flash_attn_varlen_func(
                q=query[:tokens],
                k=kv_cache.transpose(1, 2),
                v=values_cache(layer).transpose(1, 2),
                out=output[:tokens],
                cu_seqlens_q=attn_metadata.query_start_loc,
                max_seqlen_q=attn_metadata.max_query_len,
                seqused_k=attn_metadata.seq_lens,
                max_seqlen_k=attn_metadata.max_seq_len,
                softmax_scale=self.scale,
                causal=attn_metadata.causal,
                window_size=window,
                block_table=attn_metadata.block_table,
                softcap=self.logits_soft_cap,
                scheduler_metadata=attn_metadata.scheduler_metadata,
                fa_version=self.vllm_flash_attn_version,
                num_splits=attn_metadata.max_num_splits,
            )
            return output

    class FlashSharedValueBackend(FlashAttentionBackend):
        @staticmethod
        def get_impl_cls() -> type[FlashSharedValueImpl]:
            return FlashSharedValueImpl

    return FlashSharedValueBackend


SHARED_VALUE_BACKENDS = {'CPU_ATTN': lambda: CpuSharedValueBackend, 'FLASH_ATTN': flash_backend}


class SharedValueAttention(Attention):
    """vLLM's attention layer for SVFormer: a keys-only page per layer, its values read from the values
    page (`values_name`, a SharedValueAttention that is never called: layer 1's V_1 store)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, *, values_name: str, **kwargs):
        cache_config = kwargs.get('cache_config')
        if cache_config is not None and cache_config.cache_dtype != 'auto':
            raise ValueError(
                'SVFormer and SkipV1Former in vLLM store V_1 once, unquantised: '
                f'--kv-cache-dtype {cache_config.cache_dtype} is not supported (leave it auto)'
            )
        window = kwargs.get('per_layer_sliding_window')
        base = get_attn_backend(head_size, torch.get_default_dtype(), 'auto', has_sliding_window=window is not None)
        if base.get_name() not in SHARED_VALUE_BACKENDS:
            raise ValueError(
                f'SVFormer and SkipV1Former in vLLM store V_1 once on the attention backends '
                f'{sorted(SHARED_VALUE_BACKENDS)}, '
                f'not {base.get_name()}: pick one with --attention-backend'
            )
        super().__init__(num_heads, head_size, scale, attn_backend=SHARED_VALUE_BACKENDS[base.get_name()](), **kwargs)
        self.values_name = values_name

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        """Keys only (half a vanilla page), full attention even for a local layer (see the module's text)."""
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=0,
            dtype=self.kv_cache_torch_dtype,
            sliding_window=self.sliding_window,
        )
