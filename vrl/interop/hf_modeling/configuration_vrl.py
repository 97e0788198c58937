"""The configuration of vrl's models in the Hugging Face format (written by `python -m vrl.tools.export`).

Llama's fields for the decoder's shape, plus vrl's own (vrl/model/config.py's ModelConfig, same names):
attention (vanilla | resformer | svformer), lambda_mode, lambda1, lambda2, sparse_layers,
neutreno, neutreno_lambda, denseformer, kv_share, skip_v1, value_embed_layers, value_embed_tables, mudd,
mudd_layers, hyper_connections, hyper_streams, hyper_dynamic, attn_residuals, attn_residual_blocks, qk_norm; and
the soft caps under Gemma 2's names, attn_logit_softcapping and final_logit_softcapping (None: off),
and local/global attention under transformers' names: sliding_window (None: off) and layer_types
('sliding_attention' or 'full_attention' per layer).
This file and modeling_vrl.py need torch and transformers only, not vrl.
"""

from __future__ import annotations

from transformers import PreTrainedConfig


class VrlConfig(PreTrainedConfig):
    model_type = 'vrl'
    keys_to_ignore_at_inference = ['cache', 'past_key_values']

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        intermediate_size: int = 1792,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 8,
        head_dim: int = 64,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10_000.0,
        max_position_embeddings: int = 2048,
        tie_word_embeddings: bool = False,
        attention: str = 'vanilla',
        lambda_mode: str = 'identity',
        lambda1: float = 0.5,
        lambda2: float = 0.5,
        sparse_layers: tuple[int, ...] = (),
        neutreno: bool = False,
        neutreno_lambda: float = 0.4,
        denseformer: bool = False,
        kv_share: int = 1,
        skip_v1: int = 0,
        value_embed_layers: tuple[int, ...] = (),
        value_embed_tables: tuple[int, ...] = (),
        mudd: str = '',
        mudd_layers: tuple[int, ...] = (),
        hyper_connections: str = '',
        hyper_streams: int = 4,
        hyper_dynamic: bool = True,
        attn_residuals: str = '',
        attn_residual_blocks: int = 8,
        qk_norm: bool = False,
        attn_logit_softcapping: float | None = None,
        final_logit_softcapping: float | None = None,
        sliding_window: int | None = None,
        layer_types: list[str] | None = None,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.head_dim = num_key_value_heads, head_dim
        self.rms_norm_eps, self.rope_theta = rms_norm_eps, rope_theta
        self.max_position_embeddings, self.initializer_range = max_position_embeddings, initializer_range
        self.use_cache = use_cache
        self.attention, self.lambda_mode, self.lambda1, self.lambda2 = attention, lambda_mode, lambda1, lambda2
        self.sparse_layers = list(sparse_layers)
        self.neutreno, self.neutreno_lambda, self.denseformer = neutreno, neutreno_lambda, denseformer
        self.kv_share, self.skip_v1 = kv_share, skip_v1
        self.value_embed_layers, self.value_embed_tables = list(value_embed_layers), list(value_embed_tables)
        self.mudd, self.mudd_layers = mudd, list(mudd_layers)
        self.hyper_connections, self.hyper_streams, self.hyper_dynamic = hyper_connections, hyper_streams, hyper_dynamic
        self.attn_residuals, self.attn_residual_blocks = attn_residuals, attn_residual_blocks
        self.qk_norm = qk_norm
        self.attn_logit_softcapping, self.final_logit_softcapping = attn_logit_softcapping, final_logit_softcapping
        self.sliding_window = sliding_window
        self.layer_types = list(layer_types or ['full_attention'] * num_hidden_layers)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def key_owner(self, layer: int) -> int:
        """The 0-based layer whose keys `layer` attends with: the first of its CLA group."""
        return layer - layer % self.kv_share

    def value_owner(self, layer: int) -> int:
        """The 0-based layer whose cached values `layer` attends over: layer 1 (V_1) for SVFormer."""
        return 0 if self.attention == 'svformer' else self.key_owner(layer)

    def own_value_heads(self, layer: int) -> int:
        """The value heads 0-based `layer` projects: all K, but for SkipV1Former's layers >= 2, whose
        last skip_v1 are V_1's."""
        return self.num_key_value_heads - (self.skip_v1 if layer > 0 else 0)

    def value_embed_table(self, layer: int) -> int | None:
        """The value-embedding table 0-based `layer` adds to its V, or None."""
        if layer + 1 not in self.value_embed_layers:
            return None
        entry = self.value_embed_layers.index(layer + 1)
        return self.value_embed_tables[entry] if self.value_embed_tables else entry

    @property
    def residual(self) -> str:
        """How the layers connect, as vrl's model.residual names it (this config keeps each method's switch,
        as exports have since before that field): plain, dense, mudd, hc, mhc or attnres."""
        if self.denseformer:
            return 'dense'
        if self.mudd:
            return 'mudd'
        if self.attn_residuals:
            return 'attnres'
        return self.hyper_connections or 'plain'

    def mudd_after(self, layer: int) -> str:
        """The ways ('q', 'k', 'v', 'r': the next block's query, key, value and residual inputs) that a MUDD
        connection after 0-based `layer` mixes, in order; '' for none. After the last layer, r alone."""
        if not self.mudd or (self.mudd_layers and layer + 1 not in self.mudd_layers):
            return ''
        return 'r' if layer == self.num_hidden_layers - 1 else self.mudd

    def mudd_hidden(self, layer: int) -> int:
        """The hidden width of that connection's MLP: ways x (layer + 2), 4 times that after the last
        layer, rounded up past a multiple of 64."""
        width = len(self.mudd_after(layer)) * (layer + 2) * (4 if layer == self.num_hidden_layers - 1 else 1)
        return (width // 64 + 1) * 64 if width else 0
