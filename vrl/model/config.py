"""The model's config: the decoder's shape, its variant and baselines, and how its step runs (each
field's check in `__post_init__`; vrl/model/cache.py derives the KV cache's layout from it)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import ClassVar

from vrl.core.config import ConfigError, choice, require

ATTENTION_VARIANTS = ('vanilla', 'resformer', 'svformer')
LAMBDA_MODES = ('identity', 'constant', 'learnable', 'learnable_plus', 'sparse', 'per_token')
MUDD_WAYS = ('r', 'vr', 'qkvr')  # model.mudd_ways: the inputs of a block that MUDD mixes (r: the residual)
# model.residual's methods, each module registered under its name in vrl/model/residual/__init__.py's METHODS,
# and each one's own fields (ModelConfig's, beside `residual`): another method's must stay at their defaults
RESIDUAL_FIELDS = {
    'plain': (),
    'dense': (),
    'mudd': ('mudd_ways', 'mudd_layers'),
    'hc': ('hyper_streams', 'hyper_dynamic'),
    'mhc': ('hyper_streams', 'hyper_dynamic'),
    'attnres': ('attn_residual_blocks',),
}
REMAT_POLICIES = ('none', 'full', 'save_dots', 'save_qkv', 'auto')
ATTENTION_IMPLS = ('auto', 'xla', 'splash', 'cudnn', 'splash_interpret')  # vrl/model/attention.py; the last is
# what splash becomes off TPU (Pallas' interpreter)
HAND_VJP_OPS = ('project', 'attention', 'swiglu', 'cross_entropy')  # vrl/model/ops.py's hand-written backwards
COMPUTE_DTYPES = ('auto', 'float32', 'bfloat16')  # auto: vrl/model/resolve.py


# What makes a variant (presets reset them, exports record them), and what only changes how the step
# runs (a resume may change these; the checkpoint is the same model).
VARIANT_FIELDS = (
    'attention',
    'lambda_mode',
    'lambda1',
    'lambda2',
    'sparse_layers',
    'neutreno',
    'neutreno_lambda',
    'kv_share',
    'skip_v1',
    'value_embed_layers',
    'value_embed_tables',
    'residual',
    'mudd_ways',
    'mudd_layers',
    'hyper_streams',
    'hyper_dynamic',
    'attn_residual_blocks',
)
EXECUTION_FIELDS = (
    'attention_chunks',
    'head_chunks',
    'attention_impl',
    'hand_vjp',
    'scan_layers',
    'remat',
    'compute_dtype',
)


# Before model.residual, each method had its own switch; exports' config.json keeps these fields, and so do the
# ledgers' fingerprints (attn_residual_blocks then counted Block AttnRes' blocks, 8 by default, 'full' aside).
SWITCHES_BEFORE_RESIDUAL = {'denseformer': False, 'mudd': '', 'hyper_connections': '', 'attn_residuals': ''}
METHODS_BEFORE_RESIDUAL = ('plain', 'dense', 'mudd', 'hc', 'mhc', 'attnres')  # what those switches could choose
BLOCKS_BEFORE_RESIDUAL = 8
_said_upgraded: set[str] = set()


def before_residual(model: dict) -> dict:
    """A model section's fields (a dict, today's names) as configs spelled them before model.residual: each
    method's switch and no mudd_ways; model.residual kept only where it names a later method."""
    method = model.get('residual', 'plain')
    dropped = ('residual', 'mudd_ways') if method in METHODS_BEFORE_RESIDUAL else ('mudd_ways',)
    fields = {k: v for k, v in model.items() if k not in dropped}
    blocks = model.get('attn_residual_blocks', 0)
    fields.update(
        denseformer=method == 'dense',
        mudd=model.get('mudd_ways', 'qkvr') if method == 'mudd' else '',
        hyper_connections=method if method in ('hc', 'mhc') else '',
        attn_residuals=('block' if blocks else 'full') if method == 'attnres' else '',
        attn_residual_blocks=blocks or BLOCKS_BEFORE_RESIDUAL,
    )
    return fields


def upgraded(model: dict) -> dict:
    """A model section's fields with those of configs before model.residual (SWITCHES_BEFORE_RESIDUAL) read as
    today's, said once per field and value; ConfigError where they choose two methods, or another than
    model.residual."""
    old = {k: model[k] for k in SWITCHES_BEFORE_RESIDUAL if k in model}
    if not old:
        return model
    fields = {k: v for k, v in model.items() if k not in old}
    chosen = []
    if old.get('denseformer'):
        chosen.append(('dense', {}))
    if old.get('mudd'):
        chosen.append(('mudd', {'mudd_ways': old['mudd']}))
    if old.get('hyper_connections'):
        chosen.append((old['hyper_connections'], {}))
    if 'attn_residuals' in old:  # attn_residual_blocks in its earlier sense
        blocks = fields.pop('attn_residual_blocks', BLOCKS_BEFORE_RESIDUAL)
        if old['attn_residuals']:
            chosen.append(('attnres', {'attn_residual_blocks': blocks if old['attn_residuals'] == 'block' else 0}))
    given = ', '.join(f'model.{k}={v!r}' for k, v in old.items() if v)
    residual = fields.get('residual', 'plain')
    if len(chosen) > 1 or (chosen and residual not in ('plain', chosen[0][0])):
        raise ConfigError(
            f'{given} (fields of configs before model.residual) choose {" and ".join(c for c, _ in chosen)}'
            f'{"" if residual == "plain" else f" beside model.residual={residual!r}"}: one method connects '
            "the layers; set model.residual alone (vrl/model/residual/'s methods)."
        )
    fields['residual'] = residual  # plain where the switches were off: a record of a plain model says so
    if chosen:
        fields.update(residual=chosen[0][0], **chosen[0][1])
        now = ', '.join(f'model.{k}={v!r}' for k, v in {'residual': chosen[0][0], **chosen[0][1]}.items())
        if given not in _said_upgraded:
            _said_upgraded.add(given)
            logging.warning('%s is read as %s (model.residual picks how the layers connect)', given, now)
    return fields


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder shape, the value-residual variant and the paper's baselines (docs/paper.md).

    The switches compose: `attention` picks the values layers >= 2 attend over; `neutreno`,
    `kv_share` (CLA), `skip_v1` and `value_embed_layers` add the baselines and the later value-residual
    family on top (vrl/model/decoder.py shows each in one place); `residual` picks how the layers
    connect (vrl/model/residual/), each method's own fields beside it.
    """

    AUTOS: ClassVar[dict] = {
        'attention_impl': 'auto',
        'hand_vjp': 'auto',
        'compute_dtype': 'auto',
        'remat': 'auto',
    }  # resolved once per run: vrl/train/aot.py
    UPGRADE: ClassVar = staticmethod(upgraded)  # vrl.core.config.from_dict reads earlier configs' fields through it

    attention: str = 'vanilla'  # vanilla | resformer | svformer
    # ResFormer only: identity | constant | learnable | learnable_plus | sparse | per_token
    # (per_token: x-transformers' learned mix, lambda = sigmoid(x W_mix) per token and kv head)
    lambda_mode: str = 'identity'
    lambda1: float = 2.0  # weight of V_1 in 'constant' and 'sparse' modes
    lambda2: float = 1.0  # weight of V_n in 'constant' and 'sparse' modes
    sparse_layers: tuple[int, ...] = ()  # 1-based layers that get the residual in 'sparse' mode
    # NeuTRENO: layers >= 2 add neutreno_lambda * (V_1 - V) to the attention output, V the values the layer
    # attends (V_n; on ResFormer the mix, so identity lambdas give 0.5 * neutreno_lambda * (V_1 - V_n))
    neutreno: bool = False
    neutreno_lambda: float = 0.4  # the paper's value; 0.2 when stacked on ResFormer
    kv_share: int = 1  # CLA: this many adjacent layers share one K and V (2 = CLA2); the later ones own none
    # SkipV1Former: layers >= 2 take their last skip_v1 value heads (of n_kv_heads) from layer 1's values V_1 and
    # project the others; 0 = off; the paper's preset is half (vrl/model/presets.py 'skipv1')
    skip_v1: int = 0
    value_embed_layers: tuple[int, ...] = ()  # 1-based layers whose V adds a gated token-embedding lookup
    value_embed_tables: tuple[int, ...] = ()  # the table of each of those layers (shared ids share); () = own
    # How the layers connect (vrl/model/residual/, one module each): 'plain' (the standard residual stream),
    # 'dense' (DenseFormer: each block's input a learned average of all earlier outputs), 'mudd' (multiway
    # dynamic dense connections), 'hc' or 'mhc' (hyper-connections: Zhu et al.'s or DeepSeek's manifold-
    # constrained), 'attnres' (Attention Residuals). Each method's own fields follow; another's must stay at
    # their defaults.
    residual: str = 'plain'
    # 'mudd': after a layer, each way named here (q, k, v: the next attention's query, key and value inputs; r:
    # its residual) is its own mix of the embedding and every block output so far, weighted per position by a
    # small MLP of the newest output plus static weights. 'r' alone is a dynamic DenseFormer. After layer L only
    # r is mixed (the final norm's input)
    mudd_ways: str = 'qkvr'
    mudd_layers: tuple[int, ...] = ()  # 'mudd': 1-based layers followed by a connection; () = every layer
    # 'hc', 'mhc': the residual stream widened to hyper_streams streams; before each attention and MLP their
    # weighted sum is the sublayer's input, after it the streams are remixed and each adds the output with its
    # own weight
    hyper_streams: int = 4  # the expansion rate n
    hyper_dynamic: bool = True  # False ('hc' only): the weights are learned constants, the same at every position
    # 'attnres': each attention's and MLP's input is a softmax over depth, a learned query per sublayer against
    # the RMS-normalised embedding output and what the sublayers before added: 0 = full (each sublayer's output
    # its own source), N = Block AttnRes (N blocks of layers, each one source, the sum of its sublayers' outputs)
    attn_residual_blocks: int = 0
    # QK-norm: each head's queries and keys RMS-normalised over head_dim with a learned scale (Dh,), before
    # RoPE, as Qwen3 and Gemma 3 do (nanochat's has no scale; OLMo-2 normalises all heads together)
    qk_norm: bool = False
    # soft-capping, cap * tanh(x / cap), of the attention logits q.k / sqrt(Dh) and of the final logits, as
    # Gemma 2 (50 and 30) and nanochat (final 15) do; 0 = off
    attn_logits_soft_cap: float = 0.0
    final_logits_soft_cap: float = 0.0
    # local/global attention: a local layer's query sees itself and the attention_window - 1 positions before
    # it (a sliding window, Gemma 2 / nanochat); the 1-based global_layers see the whole context. 0 = all global
    attention_window: int = 0
    global_layers: tuple[int, ...] = ()
    vocab_size: int = 50277  # the tokenizer's vocabulary
    vocab_pad_multiple: int = 128  # the embedding is padded to this multiple for sharding
    n_layers: int = 8
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int = 8
    head_dim: int = 64
    d_ff: int = 1792
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_chunks: int = 4  # the XLA path's training attention (and cuDNN's on a split sequence) in this many
    # query chunks, each skipping the keys after its last query
    head_chunks: int = (
        4  # the output head and loss in this many slices of the sequence (vrl.model.ops.cross_entropy_sums)
    )
    attention_impl: str = 'auto'  # auto | xla | splash | cudnn: vrl/model/attention.py (auto: the platform's kernel)
    hand_vjp: str = 'auto'  # auto | all | none | some of HAND_VJP_OPS, comma-separated: vrl/model/ops.py's
    # ops that run their hand-written backward (the others autodiff); auto: what suits the platform
    scan_layers: bool = True
    # none | full | save_dots | save_qkv (vrl/model/decoder.py) | auto (the cheapest that fits: vrl/train/aot.py)
    remat: str = 'none'
    # auto | float32 | bfloat16; parameters are always float32. auto: bfloat16 on accelerators and on CPUs
    # with bf16 dot instructions (AVX512_BF16, AMX), float32 on other CPUs (vrl/model/resolve.py)
    compute_dtype: str = 'auto'

    def __post_init__(self):
        choice('model.attention', self.attention, ATTENTION_VARIANTS)
        choice('model.lambda_mode', self.lambda_mode, LAMBDA_MODES)
        choice('model.remat', self.remat, REMAT_POLICIES)
        choice('model.attention_impl', self.attention_impl, ATTENTION_IMPLS)
        choice('model.compute_dtype', self.compute_dtype, COMPUTE_DTYPES)
        if self.hand_vjp not in ('auto', 'all', 'none'):
            for name in self.hand_vjp.split(','):
                require(
                    name in HAND_VJP_OPS,
                    'model.hand_vjp',
                    self.hand_vjp,
                    "'auto', 'all', 'none' or a comma-separated list of " + ', '.join(map(repr, HAND_VJP_OPS)),
                )
        for name in (
            'vocab_size',
            'vocab_pad_multiple',
            'd_model',
            'n_heads',
            'n_kv_heads',
            'head_dim',
            'd_ff',
            'attention_chunks',
            'head_chunks',
        ):
            require(getattr(self, name) >= 1, f'model.{name}', getattr(self, name), 'an integer >= 1')
        require(self.n_layers >= 2, 'model.n_layers', self.n_layers, 'an integer >= 2')
        for name in ('attn_logits_soft_cap', 'final_logits_soft_cap'):
            require(getattr(self, name) >= 0, f'model.{name}', getattr(self, name), 'a cap > 0, or 0 for none')
        require(self.attention_window >= 0, 'model.attention_window', self.attention_window, 'an integer >= 0 (0: off)')
        require(
            len(set(self.global_layers)) == len(self.global_layers)
            and all(1 <= n <= self.n_layers for n in self.global_layers)
            and (self.attention_window > 0 or not self.global_layers),
            'model.global_layers',
            self.global_layers,
            f'distinct 1-based layer indices in 1..{self.n_layers}, with model.attention_window > 0',
        )
        require(
            self.n_heads % self.n_kv_heads == 0,
            'model.n_kv_heads',
            self.n_kv_heads,
            f'a divisor of model.n_heads={self.n_heads}',
        )
        require(self.head_dim % 2 == 0, 'model.head_dim', self.head_dim, 'an even integer (RoPE)')
        for layer in self.sparse_layers:
            require(
                2 <= layer <= self.n_layers,
                'model.sparse_layers',
                self.sparse_layers,
                f'1-based layer indices in 2..{self.n_layers}',
            )
        if self.attention == 'resformer' and self.lambda_mode == 'sparse':
            require(
                len(self.sparse_layers) > 0,
                'model.sparse_layers',
                self.sparse_layers,
                "a non-empty tuple of layers when model.lambda_mode='sparse'",
            )
        require(self.kv_share >= 1, 'model.kv_share', self.kv_share, 'an integer >= 1 (2 = CLA2)')
        if self.kv_share > 1:
            require(
                self.attention != 'resformer',
                'model.kv_share',
                self.kv_share,
                "1 with model.attention='resformer' (CLA's later layers have no W_V to mix with V_1)",
            )
        require(
            0 <= self.skip_v1 < self.n_kv_heads,
            'model.skip_v1',
            self.skip_v1,
            f'0 (off) or a number of value heads below model.n_kv_heads={self.n_kv_heads} (all of them: SVFormer)',
        )
        if self.skip_v1:  # layers >= 2 read V_1's last heads as layer 1 attended them
            require(
                self.attention != 'svformer',
                'model.skip_v1',
                self.skip_v1,
                "0 with model.attention='svformer' (every value head is V_1's already)",
            )
            require(
                self.value_embed_layers in ((), (1,)) and not self.per_token_mix,
                'model.skip_v1',
                self.skip_v1,
                '0 with value embeddings beyond layer 1 or the per-token mix (a gate over every value head of '
                "a later layer: V_1's heads there are layer 1's as they are)",
            )
        if self.neutreno:
            require(
                self.attention != 'svformer',
                'model.neutreno',
                self.neutreno,
                "False with model.attention='svformer' (its V_n is V_1, so V_1 - V_n is 0)",
            )
        self._check_value_embeddings()
        self._check_residual()

    def _check_residual(self) -> None:
        """model.residual one of RESIDUAL_FIELDS' methods, the other methods' fields at their defaults, and the
        method's own checks."""
        choice('model.residual', self.residual, tuple(RESIDUAL_FIELDS))
        defaults, own = ModelConfig.__dataclass_fields__, RESIDUAL_FIELDS[self.residual]
        for field in sorted({field for fields in RESIDUAL_FIELDS.values() for field in fields} - set(own)):
            owners = ' or '.join(repr(name) for name, fields in RESIDUAL_FIELDS.items() if field in fields)
            require(
                getattr(self, field) == defaults[field].default,
                f'model.{field}',
                getattr(self, field),
                f'its default, {defaults[field].default!r}, with model.residual={self.residual!r} (it is a field of '
                f'model.residual={owners})',
            )
        if self.residual == 'mudd':
            self._check_mudd()
        elif self.residual in ('hc', 'mhc'):
            self._check_hyper_connections()
        elif self.residual == 'attnres':
            self._check_attn_residuals()

    def _check_mudd(self) -> None:
        choice('model.mudd_ways', self.mudd_ways, MUDD_WAYS)
        require(
            len(set(self.mudd_layers)) == len(self.mudd_layers)
            and all(1 <= n <= self.n_layers for n in self.mudd_layers),
            'model.mudd_layers',
            self.mudd_layers,
            f'() or distinct 1-based layer indices in 1..{self.n_layers}',
        )
        require(
            'v' not in self.mudd_ways or self.attention != 'svformer',
            'model.mudd_ways',
            self.mudd_ways,
            "'r' with model.attention='svformer' (its layers >= 2 have no value projection to take a mixed input)",
        )
        require(
            'v' not in self.mudd_ways or self.kv_share == 1,
            'model.mudd_ways',
            self.mudd_ways,
            f"'r' with model.kv_share={self.kv_share} (CLA's borrowing layers project no keys or values)",
        )

    def _check_hyper_connections(self) -> None:
        require(self.hyper_streams >= 1, 'model.hyper_streams', self.hyper_streams, 'an integer >= 1 (4 = the papers)')
        require(
            self.hyper_dynamic or self.residual != 'mhc',
            'model.hyper_dynamic',
            self.hyper_dynamic,
            "True with model.residual='mhc' (its biases start alike for every stream and a doubly stochastic remix "
            'of identical streams is the identity, so without the dynamic terms the streams never differ)',
        )

    def _check_attn_residuals(self) -> None:
        blocks = self.attn_residual_blocks
        require(
            blocks == 0 or (1 <= blocks <= self.n_layers and self.n_layers % blocks == 0),
            'model.attn_residual_blocks',
            blocks,
            f'0 (full) or a divisor of model.n_layers={self.n_layers} (Block AttnRes: blocks of whole layers)',
        )

    @property
    def attn_residual_layers(self) -> int:
        """Block AttnRes: the layers of each block (full: 0, each sublayer its own source)."""
        return (
            self.n_layers // self.attn_residual_blocks
            if self.residual == 'attnres' and self.attn_residual_blocks
            else 0
        )

    def _check_value_embeddings(self) -> None:
        layers, tables = self.value_embed_layers, self.value_embed_tables
        require(
            len(set(layers)) == len(layers) and all(1 <= n <= self.n_layers for n in layers),
            'model.value_embed_layers',
            layers,
            f'distinct 1-based layer indices in 1..{self.n_layers}',
        )
        owners = [n for n in layers if (n - 1) % self.kv_share == 0 and (n == 1 or self.attention != 'svformer')]
        require(
            owners == list(layers),
            'model.value_embed_layers',
            layers,
            'layers that project their own values (layer 1 only for SVFormer; with model.kv_share='
            f'{self.kv_share}, layers 1, {1 + self.kv_share}, ...)',
        )
        require(
            not tables or (len(tables) == len(layers) and set(tables) == set(range(max(tables) + 1))),
            'model.value_embed_tables',
            tables,
            f'() or one table id per value_embed_layers entry ({len(layers)}), using every id 0..T-1',
        )

    def mudd_after(self, layer: int) -> str:
        """The ways a MUDD connection after 0-based `layer` mixes, in order ('qkvr', 'vr', 'r'), or '' for none."""
        if self.residual != 'mudd' or (self.mudd_layers and layer + 1 not in self.mudd_layers):
            return ''
        return 'r' if layer == self.n_layers - 1 else self.mudd_ways

    def mudd_hidden(self, layer: int) -> int:
        """The width of the MLP that weighs the mixes after 0-based `layer`, as the authors' JAX sizes it:
        ways x (layer + 2) inputs, 4 times that after the last layer, rounded up past a multiple of 64."""
        width = len(self.mudd_after(layer)) * (layer + 2) * (4 if layer == self.n_layers - 1 else 1)
        return (width // 64 + 1) * 64 if width else 0

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple

    @property
    def per_token_mix(self) -> bool:
        """ResFormer's learned per-token mix (lambda_mode per_token): w_mix in layers >= 2, no scalar lambdas."""
        return self.attention == 'resformer' and self.lambda_mode == 'per_token'

    def as_vanilla(self) -> 'ModelConfig':
        """The same shape and execution settings with every VARIANT_FIELDS field at its default (vanilla)."""
        defaults = ModelConfig()
        return dataclasses.replace(self, **{field: getattr(defaults, field) for field in VARIANT_FIELDS})

    @property
    def n_stacked(self) -> int:
        """Layers 2..L, the ones the scan walks."""
        return self.n_layers - 1

    def is_local(self, layer: int) -> bool:
        """Whether 0-based `layer` attends within model.attention_window (a local layer)."""
        return self.attention_window > 0 and layer + 1 not in self.global_layers

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """`is_local` of every layer, in order."""
        return tuple(self.is_local(layer) for layer in range(self.n_layers))

    @property
    def variant_name(self) -> str:
        """What the model is, in a few words: 'resformer (learnable_plus) + NeuTRENO 0.2 + GQA4'."""
        parts = [self.attention + (f' ({self.lambda_mode})' if self.attention == 'resformer' else '')]
        if self.neutreno:
            parts.append(f'NeuTRENO {self.neutreno_lambda:g}')
        if self.kv_share > 1:
            parts.append(f'CLA{self.kv_share}')
        if self.skip_v1:
            parts.append(f'SkipV1 {self.skip_v1}/{self.n_kv_heads}')
        if self.value_embed_layers:
            tables = max(self.value_embed_table_ids) + 1
            parts.append(
                f'value embeddings on layers {",".join(map(str, self.value_embed_layers))} '
                f'({tables} table{"s" if tables > 1 else ""})'
            )
        if self.residual != 'plain':
            parts.append(self._residual_name())
        if self.n_kv_heads != self.n_heads:
            parts.append('MQA' if self.n_kv_heads == 1 else f'GQA{self.n_heads // self.n_kv_heads}')
        if self.qk_norm:
            parts.append('QK-norm')
        if self.attention_window:
            kept = f', global layers {",".join(map(str, self.global_layers))}' if self.global_layers else ''
            parts.append(f'window {self.attention_window}{kept}')
        if self.attn_logits_soft_cap or self.final_logits_soft_cap:
            caps = [
                f'{what} {cap:g}'
                for what, cap in (('attention', self.attn_logits_soft_cap), ('final', self.final_logits_soft_cap))
                if cap
            ]
            parts.append(f'logits capped ({", ".join(caps)})')
        return ' + '.join(parts)

    def _residual_name(self) -> str:
        """model.residual's part of `variant_name`: 'MUDD-vr after layers 6,7,8', 'MHC x4', 'AttnRes full'."""
        if self.residual == 'mudd':
            after = f' after layers {",".join(map(str, self.mudd_layers))}' if self.mudd_layers else ''
            return f'MUDD-{self.mudd_ways}{after}'
        if self.residual in ('hc', 'mhc'):
            return f'{self.residual.upper()} x{self.hyper_streams}{"" if self.hyper_dynamic else " static"}'
        if self.residual == 'attnres':
            blocks = self.attn_residual_blocks
            return f'AttnRes block ({blocks} blocks)' if blocks else 'AttnRes full'
        return {'dense': 'DenseFormer'}[self.residual]

    @property
    def value_embed_table_ids(self) -> tuple[int, ...]:
        """The table of each layer in value_embed_layers."""
        return self.value_embed_tables or tuple(range(len(self.value_embed_layers)))
