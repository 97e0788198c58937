"""The config schema: every field vrl reads, its default (the paper's recipe) and its check.

`configs/*.py` return an `ml_collections.ConfigDict` made from `Config()` by `to_configdict`;
command-line overrides edit that dict; `from_configdict` turns it back into these frozen
dataclasses and validates every field here, in one place. Code below `vrl.main` only ever
sees the dataclasses, so an undeclared key can never be read with a silent default.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import ml_collections

from vrl.core.errors import VrlError

ATTENTION_VARIANTS = ('vanilla', 'resformer', 'svformer')
LAMBDA_MODES = ('identity', 'constant', 'learnable', 'learnable_plus', 'sparse', 'per_token')
MUDD_WAYS = ('', 'r', 'vr', 'qkvr')  # model.mudd: the inputs of a block that MUDD mixes (r: the residual)
HYPER_CONNECTIONS = ('', 'hc', 'mhc')  # model.hyper_connections: vrl/model/hyper.py
REMAT_POLICIES = ('none', 'full', 'save_dots', 'auto')
ATTENTION_IMPLS = ('auto', 'xla', 'splash', 'cudnn', 'splash_interpret')  # vrl/model/attention.py; the last is
# what splash becomes off TPU (Pallas' interpreter)
HAND_VJP_OPS = ('project', 'attention', 'swiglu', 'cross_entropy')  # vrl/model/ops.py's hand-written backwards
COMPUTE_DTYPES = ('auto', 'float32', 'bfloat16')  # auto: vrl/model/resolve.py
NAN_POLICIES = ('error', 'skip')
MIN_LEASE_STALE_SECONDS = 8  # vrl/train/lease.py's Lease renews every quarter of it
OPTIMIZERS = ('adamw', 'muon')  # vrl/train/optimizer.py
SCHEDULES = ('cosine', 'wsd')
DECAY_SHAPES = ('linear', 'sqrt')  # wsd's decay: linear, or 1 - sqrt


class ConfigError(VrlError, ValueError):
    """An invalid config value; the message names the field and what is allowed."""


def _require(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f'{field}={value!r} is invalid: allowed {allowed}.')


def _choice(field: str, value: Any, allowed: Sequence[str]) -> None:
    _require(value in allowed, field, value, 'one of ' + ', '.join(map(repr, allowed)))


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
    'denseformer',
    'kv_share',
    'value_embed_layers',
    'value_embed_tables',
    'mudd',
    'mudd_layers',
    'hyper_connections',
    'hyper_streams',
    'hyper_dynamic',
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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder shape, the value-residual variant and the paper's baselines (docs/paper.md).

    The switches compose: `attention` picks the values layers >= 2 attend over; `neutreno`,
    `denseformer`, `kv_share` (CLA) and `value_embed_layers` add the baselines and the later
    value-residual family on top (vrl/model/decoder.py shows each in one place).
    """

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
    denseformer: bool = False  # DenseFormer: each block's input is a learned average of all earlier outputs
    kv_share: int = 1  # CLA: this many adjacent layers share one K and V (2 = CLA2); the later ones own none
    value_embed_layers: tuple[int, ...] = ()  # 1-based layers whose V adds a gated token-embedding lookup
    value_embed_tables: tuple[int, ...] = ()  # the table of each of those layers (shared ids share); () = own
    # MUDD (multiway dynamic dense connections): after a layer, each of the next block's inputs named here
    # (q, k, v: its attention's; r: its residual) is its own mix of the embedding and every block output so
    # far, weighted per position by a small MLP of the newest output plus static weights. 'r' alone is a
    # dynamic DenseFormer; '' = off. After layer L only r is mixed (the final norm's input)
    mudd: str = ''
    mudd_layers: tuple[int, ...] = ()  # 1-based layers followed by a connection; () = every layer
    # hyper-connections: the residual stream widened to hyper_streams streams; before each attention and MLP
    # their weighted sum is the sublayer's input, after it the streams are remixed and each adds the output
    # with its own weight. 'hc': Zhu et al.'s weights (static + tanh-gated dynamic); 'mhc': DeepSeek's
    # manifold-constrained ones (sigmoid input and output weights, a doubly stochastic remix); '' = off
    hyper_connections: str = ''
    hyper_streams: int = 4  # the expansion rate n
    hyper_dynamic: bool = True  # False (hc only): the weights are learned constants, the same at every position
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
    remat: str = 'none'  # none | full | save_dots | auto (the cheapest that fits: vrl/train/aot.py)
    # auto | float32 | bfloat16; parameters are always float32. auto: bfloat16 on accelerators and on CPUs
    # with bf16 dot instructions (AVX512_BF16, AMX), float32 on other CPUs (vrl/model/resolve.py)
    compute_dtype: str = 'auto'

    def __post_init__(self):
        _choice('model.attention', self.attention, ATTENTION_VARIANTS)
        _choice('model.lambda_mode', self.lambda_mode, LAMBDA_MODES)
        _choice('model.remat', self.remat, REMAT_POLICIES)
        _choice('model.attention_impl', self.attention_impl, ATTENTION_IMPLS)
        _choice('model.compute_dtype', self.compute_dtype, COMPUTE_DTYPES)
        if self.hand_vjp not in ('auto', 'all', 'none'):
            for name in self.hand_vjp.split(','):
                _require(
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
            _require(getattr(self, name) >= 1, f'model.{name}', getattr(self, name), 'an integer >= 1')
        _require(self.n_layers >= 2, 'model.n_layers', self.n_layers, 'an integer >= 2')
        for name in ('attn_logits_soft_cap', 'final_logits_soft_cap'):
            _require(getattr(self, name) >= 0, f'model.{name}', getattr(self, name), 'a cap > 0, or 0 for none')
        _require(
            self.attention_window >= 0, 'model.attention_window', self.attention_window, 'an integer >= 0 (0: off)'
        )
        _require(
            len(set(self.global_layers)) == len(self.global_layers)
            and all(1 <= n <= self.n_layers for n in self.global_layers)
            and (self.attention_window > 0 or not self.global_layers),
            'model.global_layers',
            self.global_layers,
            f'distinct 1-based layer indices in 1..{self.n_layers}, with model.attention_window > 0',
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            'model.n_kv_heads',
            self.n_kv_heads,
            f'a divisor of model.n_heads={self.n_heads}',
        )
        _require(self.head_dim % 2 == 0, 'model.head_dim', self.head_dim, 'an even integer (RoPE)')
        for layer in self.sparse_layers:
            _require(
                2 <= layer <= self.n_layers,
                'model.sparse_layers',
                self.sparse_layers,
                f'1-based layer indices in 2..{self.n_layers}',
            )
        if self.attention == 'resformer' and self.lambda_mode == 'sparse':
            _require(
                len(self.sparse_layers) > 0,
                'model.sparse_layers',
                self.sparse_layers,
                "a non-empty tuple of layers when model.lambda_mode='sparse'",
            )
        _require(self.kv_share >= 1, 'model.kv_share', self.kv_share, 'an integer >= 1 (2 = CLA2)')
        if self.kv_share > 1:
            _require(
                self.attention != 'resformer',
                'model.kv_share',
                self.kv_share,
                "1 with model.attention='resformer' (CLA's later layers have no W_V to mix with V_1)",
            )
        if self.neutreno:
            _require(
                self.attention != 'svformer',
                'model.neutreno',
                self.neutreno,
                "False with model.attention='svformer' (its V_n is V_1, so V_1 - V_n is 0)",
            )
        self._check_value_embeddings()
        self._check_mudd()
        self._check_hyper_connections()

    def _check_mudd(self) -> None:
        _choice('model.mudd', self.mudd, MUDD_WAYS)
        _require(
            len(set(self.mudd_layers)) == len(self.mudd_layers)
            and all(1 <= n <= self.n_layers for n in self.mudd_layers)
            and (self.mudd or not self.mudd_layers),
            'model.mudd_layers',
            self.mudd_layers,
            f'() or distinct 1-based layer indices in 1..{self.n_layers}, with model.mudd set',
        )
        if not self.mudd:
            return
        _require(
            not self.denseformer,
            'model.mudd',
            self.mudd,
            "'' with model.denseformer (both make each block's residual input a mix of all earlier outputs)",
        )
        _require(
            'v' not in self.mudd or self.attention != 'svformer',
            'model.mudd',
            self.mudd,
            "'r' with model.attention='svformer' (its layers >= 2 have no value projection to take a mixed input)",
        )
        _require(
            'v' not in self.mudd or self.kv_share == 1,
            'model.mudd',
            self.mudd,
            f"'r' with model.kv_share={self.kv_share} (CLA's borrowing layers project no keys or values)",
        )

    def _check_hyper_connections(self) -> None:
        _choice('model.hyper_connections', self.hyper_connections, HYPER_CONNECTIONS)
        _require(self.hyper_streams >= 1, 'model.hyper_streams', self.hyper_streams, 'an integer >= 1 (4 = the papers)')
        _require(
            self.hyper_dynamic or self.hyper_connections != 'mhc',
            'model.hyper_dynamic',
            self.hyper_dynamic,
            "True with model.hyper_connections='mhc' (its biases start alike for every stream and a doubly "
            'stochastic remix of identical streams is the identity, so without the dynamic terms the streams '
            'never differ)',
        )
        for field, on in (('denseformer', self.denseformer), ('mudd', bool(self.mudd))):
            _require(
                not (on and self.hyper_connections),
                'model.hyper_connections',
                self.hyper_connections,
                f"'' with model.{field} (both rewrite the residual stream between layers)",
            )

    def _check_value_embeddings(self) -> None:
        layers, tables = self.value_embed_layers, self.value_embed_tables
        _require(
            len(set(layers)) == len(layers) and all(1 <= n <= self.n_layers for n in layers),
            'model.value_embed_layers',
            layers,
            f'distinct 1-based layer indices in 1..{self.n_layers}',
        )
        owners = [n for n in layers if (n - 1) % self.kv_share == 0 and (n == 1 or self.attention != 'svformer')]
        _require(
            owners == list(layers),
            'model.value_embed_layers',
            layers,
            'layers that project their own values (layer 1 only for SVFormer; with model.kv_share='
            f'{self.kv_share}, layers 1, {1 + self.kv_share}, ...)',
        )
        _require(
            not tables or (len(tables) == len(layers) and set(tables) == set(range(max(tables) + 1))),
            'model.value_embed_tables',
            tables,
            f'() or one table id per value_embed_layers entry ({len(layers)}), using every id 0..T-1',
        )

    def mudd_after(self, layer: int) -> str:
        """The ways a MUDD connection after 0-based `layer` mixes, in order ('qkvr', 'vr', 'r'), or '' for none."""
        if not self.mudd or (self.mudd_layers and layer + 1 not in self.mudd_layers):
            return ''
        return 'r' if layer == self.n_layers - 1 else self.mudd

    def mudd_hidden(self, layer: int) -> int:
        """The width of the MLP that weighs the mixes after 0-based `layer`, as the authors' JAX sizes it:
        ways x (layer + 2) inputs, 4 times that after the last layer, rounded up past a multiple of 64."""
        width = len(self.mudd_after(layer)) * (layer + 2) * (4 if layer == self.n_layers - 1 else 1)
        return (width // 64 + 1) * 64 if width else 0

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple

    @property
    def resolved_compute_dtype(self) -> str:
        """compute_dtype where it is resolved ('float32' or 'bfloat16'); 'auto' is a ConfigError here."""
        if self.compute_dtype == 'auto':
            raise ConfigError(
                "model.compute_dtype='auto' is unresolved here: vrl.model.resolve.execution resolves it "
                'for a platform (a TrainSteps does it itself).'
            )
        return self.compute_dtype

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
        if self.denseformer:
            parts.append('DenseFormer')
        if self.kv_share > 1:
            parts.append(f'CLA{self.kv_share}')
        if self.value_embed_layers:
            tables = max(self.value_embed_table_ids) + 1
            parts.append(
                f'value embeddings on layers {",".join(map(str, self.value_embed_layers))} '
                f'({tables} table{"s" if tables > 1 else ""})'
            )
        if self.mudd:
            after = f' after layers {",".join(map(str, self.mudd_layers))}' if self.mudd_layers else ''
            parts.append(f'MUDD-{self.mudd}{after}')
        if self.hyper_connections:
            static = '' if self.hyper_dynamic else ' static'
            parts.append(f'{self.hyper_connections.upper()} x{self.hyper_streams}{static}')
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

    @property
    def value_embed_table_ids(self) -> tuple[int, ...]:
        """The table of each layer in value_embed_layers."""
        return self.value_embed_tables or tuple(range(len(self.value_embed_layers)))


def _eval_set(entry: str, default_split: str) -> tuple[str, str]:
    """'NAME:SPLIT' -> (NAME, SPLIT); 'NAME' (a TFDS name may end in ':VERSION') -> (NAME, default_split)."""
    name, _, split = entry.rpartition(':')
    if not name or re.fullmatch(r'\d+(\.\d+)*', split):
        return entry, default_split
    return name, split


SHUFFLES = ('auto', 'documents', 'windows')  # data.shuffle


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline: a TFDS array_record dataset, a tokenizer, packing, grain."""

    name: str = 'shakespeare'  # a TFDS name ('c4/en:3.1.0', 'lm1b') or one built by `vrl.data prepare`
    data_dir: str = ''  # '' = ~/.cache/vrl/tensorflow_datasets; gs:// works on Cloud
    train_split: str = 'train'
    eval_split: str = 'validation'
    text_field: str = 'text'
    # a sentencepiece .model or a Hugging Face tokenizer.json; '' = train a .model on the train split, cached
    tokenizer: str = ''
    tokenizer_train_docs: int = 100_000  # documents read to train a tokenizer when none is given
    seq_len: int = 2048
    batch_size: int = 1024  # global, over all processes
    seed: int = 0
    num_epochs: int = 0  # 0 = repeat forever
    # read a dataset's ids from its pre-tokenized copy for this tokenizer when it has one (`vrl.data
    # tokenize`; the log says which); false = tokenize on the fly
    pretokenized: bool = True
    num_workers: int = 0  # grain worker processes; 0 = in the main process
    # threads reading blocks of documents ahead in each process (on an object store, the ranged reads
    # in flight); 0 = read when needed; -1 = auto: 0 on local disk, 64 for a data_dir on a store
    read_threads: int = -1
    prefetch: int = 2  # batches packed ahead, on a thread beside the step
    # how training's documents are shuffled (docs/data.md): 'documents' = globally, in small blocks of
    # about a sequence of text each; 'windows' = whole I/O blocks of data.block_tokens tokens (one
    # read each), permuted every epoch, documents shuffled within windows of data.window_blocks
    # blocks, each process taking whole windows; 'auto' = windows for a pre-tokenized copy on an
    # object store, documents otherwise
    shuffle: str = 'auto'
    block_tokens: int = 0  # tokens of an I/O block in windows (never across a shard); 0 = auto: 256K or a shard
    window_blocks: int = 64  # blocks whose documents are shuffled together
    add_bos: bool = False  # put BOS at every document start (EOS always ends one)
    document_masking: bool = False  # segment ids + per-document positions: no attention across docs
    # several datasets instead of `name`: 'NAME=WEIGHT,NAME=WEIGHT' (each dataset's share of the tokens;
    # each dataset's validation split is evaluated on its own); '' = `name` alone
    mixture: str = ''
    # the mixture's weights from a step on: 'STEP:NAME=WEIGHT,...;STEP:...' (a dataset left out, or at
    # weight 0, is not read from STEP on); '' = data.mixture's weights throughout
    mixture_schedule: str = ''
    # what evaluation reads: 'NAME' or 'NAME:SPLIT' (a prepared dataset's split; SPLIT defaults to
    # eval_split), comma-separated, each reported by name; '' = eval_split of each dataset trained on
    eval: str = ''
    # resume although the tokenizer or a dataset's contents changed since the run's last start (said in
    # the log; config.json records what each start read)
    allow_data_change: bool = False

    def __post_init__(self):
        for name in ('seq_len', 'batch_size', 'tokenizer_train_docs'):
            _require(getattr(self, name) >= 1, f'data.{name}', getattr(self, name), 'an integer >= 1')
        for name in ('num_epochs', 'num_workers', 'prefetch'):
            _require(getattr(self, name) >= 0, f'data.{name}', getattr(self, name), 'an integer >= 0')
        _require(self.shuffle in SHUFFLES, 'data.shuffle', self.shuffle, f'one of {SHUFFLES}')
        _require(self.block_tokens >= 0, 'data.block_tokens', self.block_tokens, 'an integer >= 1, or 0 (auto)')
        _require(self.window_blocks >= 1, 'data.window_blocks', self.window_blocks, 'an integer >= 1')
        _require(self.read_threads >= -1, 'data.read_threads', self.read_threads, 'an integer >= 0, or -1 (auto)')
        _require(bool(self.name), 'data.name', self.name, 'a non-empty TFDS dataset name')
        self.evaluated()  # parses data.eval, or names what is wrong
        if self.mixture:
            self.sources()  # parses, or names what is wrong
            _require(
                self.num_epochs == 0,
                'data.num_epochs',
                self.num_epochs,
                '0 with data.mixture (a mixture repeats its datasets forever; stop with train.steps)',
            )
        _require(
            not self.mixture_schedule or bool(self.mixture),
            'data.mixture_schedule',
            self.mixture_schedule,
            "'' without data.mixture (it changes the mixture's weights)",
        )
        self.phases()  # parses data.mixture_schedule, or names what is wrong

    def evaluated(self) -> list[tuple[str, str]]:
        """(dataset name, split) of each evaluation set: data.eval's, or each trained dataset's eval_split."""
        if not self.eval:
            return [(name, self.eval_split) for name, _ in self.sources()]
        sets = [_eval_set(entry.strip(), self.eval_split) for entry in self.eval.split(',')]
        _require(
            all(name for name, _ in sets) and len(set(sets)) == len(sets),
            'data.eval',
            self.eval,
            "comma-separated distinct NAME or NAME:SPLIT entries, e.g. 'web,books:test'",
        )
        return sets

    def sources(self) -> list[tuple[str, float]]:
        """(dataset name, weight) for each dataset trained on: data.mixture's, or [(data.name, 1.0)]."""
        if not self.mixture:
            return [(self.name, 1.0)]
        return list(_weights('data.mixture', self.mixture, self.mixture, 'weights > 0, e.g. wiki=3,books=1').items())

    def phases(self) -> list[tuple[int, tuple[float, ...]]]:
        """(first step, each of sources()' datasets' weight) of each phase of the mixture, by step:
        data.mixture's from step 0, then data.mixture_schedule's."""
        names = [name for name, _ in self.sources()]
        phases = [(0, tuple(weight for _, weight in self.sources()))]
        if not self.mixture_schedule:
            return phases
        field, allowed = 'data.mixture_schedule', "';'-separated STEP:NAME=WEIGHT,... entries with rising steps > 0"
        for entry in self.mixture_schedule.split(';'):
            step, _, weights = entry.strip().partition(':')
            _require(
                step.isdigit() and int(step) > phases[-1][0],
                field,
                self.mixture_schedule,
                f'{allowed} ({entry.strip()!r} is not)',
            )
            given = _weights(
                field, self.mixture_schedule, weights, "weights >= 0 of data.mixture's datasets", zero_allowed=True
            )
            _require(
                set(given) <= set(names) and any(given.values()),
                field,
                self.mixture_schedule,
                f"{allowed}, naming only data.mixture's datasets ({', '.join(names)}), one at weight > 0 "
                f'({entry.strip()!r} is not)',
            )
            phases.append((int(step), tuple(given.get(name, 0.0) for name in names)))
        return phases


def _weights(field: str, value: str, pairs: str, allowed: str, zero_allowed: bool = False) -> dict[str, float]:
    """'NAME=WEIGHT,...' -> {name: weight}, each weight finite and > 0 (or 0 where `zero_allowed`)."""
    allowed = f'comma-separated NAME=WEIGHT pairs with distinct names and {allowed}'
    weights = {}
    for entry in pairs.split(','):
        name, _, weight = entry.strip().rpartition('=')
        try:
            number = float(weight)
        except ValueError:
            number = math.nan
        _require(
            bool(name)
            and name not in weights
            and math.isfinite(number)
            and (number > 0 or zero_allowed and number == 0),
            field,
            value,
            f'{allowed} ({entry.strip()!r} is not)',
        )
        weights[name] = number
    return weights


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The update rule and its LR schedule (vrl/train/optimizer.py; docs/training.md, 'Optimizers').

    adamw is docs/paper.md's recipe; muon puts the hidden weight matrices under Muon at peak_lr and
    the rest under AdamW at peak_lr times its group's ratio. cosine warms up, then follows a cosine
    to final_lr at decay_steps; wsd warms up, holds peak_lr, then decays to final_lr over the last
    decay_fraction of decay_steps.
    """

    name: str = 'adamw'  # adamw | muon
    peak_lr: float = 6e-4  # the hidden matrices' peak LR (under muon: Muon's)
    init_lr: float = 1e-7
    final_lr: float = 6e-5
    warmup_steps: int = 120
    decay_steps: int = 0  # step at which the schedule reaches final_lr; 0 = train.steps (ends with the run)
    schedule: str = 'cosine'  # cosine | wsd
    decay_fraction: float = 0.2  # wsd: decays over the last this fraction of decay_steps
    decay_shape: str = 'linear'  # wsd: linear | sqrt (1 - sqrt of the decay's progress)
    # each AdamW group's LR / peak_lr (the schedule scales them all alike)
    embed_lr_ratio: float = 1.0  # token and value embedding tables
    head_lr_ratio: float = 1.0  # the output projection
    scalar_lr_ratio: float = 1.0  # norms, lambdas, gates, DenseFormer weights
    b1: float = 0.9  # AdamW
    b2: float = 0.95
    eps: float = 1e-8
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the hidden matrices
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per update
    weight_decay: float = 0.1  # decoupled (times the LR); not on norm weights or lambdas
    grad_clip: float = 1.0  # global norm; 0 = off
    z_loss: float = 0.0  # weight of log(Z)^2; 0 = off

    def __post_init__(self):
        _choice('optimizer.name', self.name, OPTIMIZERS)
        _choice('optimizer.schedule', self.schedule, SCHEDULES)
        _choice('optimizer.decay_shape', self.decay_shape, DECAY_SHAPES)
        _require(self.peak_lr > 0, 'optimizer.peak_lr', self.peak_lr, 'a float > 0')
        _require(self.warmup_steps >= 0, 'optimizer.warmup_steps', self.warmup_steps, 'an integer >= 0')
        _require(
            self.decay_steps == 0 or self.decay_steps > self.warmup_steps,
            'optimizer.decay_steps',
            self.decay_steps,
            f'0 (train.steps) or an integer > optimizer.warmup_steps={self.warmup_steps}',
        )
        _require(0 < self.decay_fraction <= 1, 'optimizer.decay_fraction', self.decay_fraction, 'a float in (0, 1]')
        if self.schedule == 'wsd' and self.decay_steps:
            _require(
                self.decay_start >= self.warmup_steps,
                'optimizer.decay_fraction',
                self.decay_fraction,
                f'a fraction whose decay starts after warmup (decay_steps={self.decay_steps} x (1 - '
                f'{self.decay_fraction}) = {self.decay_start} < warmup_steps={self.warmup_steps})',
            )
        _require(self.eps > 0, 'optimizer.eps', self.eps, 'a float > 0')
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, 'optimizer.b1/b2', (self.b1, self.b2), 'floats in [0, 1)')
        _require(0 <= self.muon_momentum < 1, 'optimizer.muon_momentum', self.muon_momentum, 'a float in [0, 1)')
        _require(self.muon_ns_steps >= 1, 'optimizer.muon_ns_steps', self.muon_ns_steps, 'an integer >= 1')
        for name in ('embed_lr_ratio', 'head_lr_ratio', 'scalar_lr_ratio'):
            _require(getattr(self, name) > 0, f'optimizer.{name}', getattr(self, name), 'a float > 0')
        for name in ('init_lr', 'final_lr', 'weight_decay', 'grad_clip', 'z_loss'):
            _require(getattr(self, name) >= 0, f'optimizer.{name}', getattr(self, name), 'a float >= 0')

    @property
    def decay_start(self) -> int:
        """wsd: the last step at peak_lr (the stable phase's end; a run extends from its checkpoint)."""
        return self.decay_steps - round(self.decay_fraction * self.decay_steps)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop: length, logging, eval, checkpoints."""

    steps: int = 10_000  # 0: save the initial (e.g. --init_from) parameters as step 0 and stop
    microbatches: int = 1  # gradient accumulation: data.batch_size is split into this many; 0 = auto (vrl/train/aot.py)
    seed: int = 0  # parameter init
    log_every: int = 10
    # the terminal's training line every this many steps (0: at every log_every record; compare and study
    # record every step for their curves and print at the config's log_every)
    print_every: int = 0
    eval_every: int = 500  # 0 = only at the end
    eval_batches: int = 16  # 0 = the whole validation split
    checkpoint_every: int = 1000
    # also save after this many minutes without a save (a slice preempted without notice loses at most that);
    # such a step is kept only until the next save, apart from the checkpoint_every ones; 0 = off
    checkpoint_minutes: float = 0.0
    keep_checkpoints: int = 3
    keep_period: int = 0  # also keep every k-th step forever; 0 = off
    nan_policy: str = 'error'  # error: stop naming the step | skip: drop that update
    # with nan_policy=skip: stop after more non-finite steps than this in a row; a run that skipped more than
    # half of its steps also ends with an error (after saving)
    max_skipped_steps: int = 20
    # at the end, a greedy continuation of sample_prompt ('' = the opening words of the validation split's first
    # document) of up to sample_tokens tokens (0 = none)
    sample_prompt: str = ''
    sample_tokens: int = 48
    peak_flops: float = 0.0  # per device, for MFU; 0 = device table, or a matmul probe on CPU
    # a workdir on an object store: a writer's lease not renewed for this long is taken over (vrl/train/lease.py);
    # at least MIN_LEASE_STALE_SECONDS, as it is renewed every quarter of it and GCS takes one write a second per object
    lease_stale_seconds: int = 300
    # per-layer attention diagnostics (vrl/train/diagnostics.py) on the first diagnostics_sequences full validation
    # sequences, every this many steps, into metrics.jsonl and TensorBoard; 0 = off
    diagnostics_every: int = 100
    diagnostics_sequences: int = 8
    # lm-eval tasks (comma-separated names; requirements-extra.txt) scored on the live parameters every
    # downstream_every steps (0 = only at the end) and at the end, logged as downstream/TASK/METRIC
    # (vrl/train/downstream.py); '' = none
    downstream_tasks: str = ''
    downstream_every: int = 1000
    downstream_limit: int = 0  # examples per task; 0 = all
    downstream_fewshot: int = -1  # few-shot examples; -1 = each task's default
    downstream_include_path: str = ''  # a folder of task YAMLs of your own (lm-eval's include_path)
    # Weights & Biases (vrl/train/trackers/wandb.py, requirements-extra.txt): everything the run logs, from process
    # 0; '' = off
    wandb_project: str = ''
    wandb_entity: str = ''  # '' = your default entity
    wandb_run_name: str = ''  # '' = the workdir's name

    def __post_init__(self):
        _choice('train.nan_policy', self.nan_policy, NAN_POLICIES)
        _require(
            self.lease_stale_seconds >= MIN_LEASE_STALE_SECONDS,
            'train.lease_stale_seconds',
            self.lease_stale_seconds,
            f'an integer >= {MIN_LEASE_STALE_SECONDS}',
        )
        for name in ('log_every', 'checkpoint_every', 'keep_checkpoints', 'diagnostics_sequences'):
            _require(getattr(self, name) >= 1, f'train.{name}', getattr(self, name), 'an integer >= 1')
        for name in (
            'steps',
            'microbatches',
            'print_every',
            'eval_every',
            'eval_batches',
            'keep_period',
            'sample_tokens',
            'max_skipped_steps',
            'diagnostics_every',
            'checkpoint_minutes',
            'downstream_every',
            'downstream_limit',
        ):
            _require(getattr(self, name) >= 0, f'train.{name}', getattr(self, name), 'an integer >= 0')
        _require(
            self.downstream_fewshot >= -1,
            'train.downstream_fewshot',
            self.downstream_fewshot,
            "-1 (each task's default) or an integer >= 0",
        )
        _require(
            all(self.task_names) or not self.downstream_tasks.strip(),
            'train.downstream_tasks',
            self.downstream_tasks,
            "lm-eval task names separated by commas, such as 'hellaswag,piqa'",
        )

    @property
    def task_names(self) -> list[str]:
        """train.downstream_tasks as a list ([] = none)."""
        return [t.strip() for t in self.downstream_tasks.split(',')] if self.downstream_tasks.strip() else []


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; -1 = all remaining devices (at most one axis)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    slices: int = 1  # TPU slices joined over the data-center network: the outer part of `data`
    context: int = 1  # devices each sequence is split over (context parallelism), within a slice; 0 = auto

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        _require(
            all(s == -1 or s >= 1 for s in sizes) and sizes.count(-1) <= 1,
            'mesh',
            sizes,
            'sizes >= 1 with at most one -1',
        )
        _require(self.slices >= 1, 'mesh.slices', self.slices, 'an integer >= 1')
        _require(
            self.context >= 1 or (self.context == 0 and -1 in sizes),
            'mesh.context',
            self.context,
            'an integer >= 1, or 0 (auto: vrl/train/aot.py picks it) with one of mesh.data, mesh.fsdp, '
            'mesh.tensor at -1 to take the rest',
        )


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        _require(
            self.train.microbatches == 0 or self.data.batch_size % self.train.microbatches == 0,
            'train.microbatches',
            self.train.microbatches,
            f'0 (auto) or a divisor of data.batch_size={self.data.batch_size}',
        )


def _int_tuple(field: str, value: Any) -> tuple[int, ...]:
    """A tuple of ints from a tuple/list, one int, or '1,2,3' as typed on the command line."""
    if isinstance(value, str):
        value = [v for v in value.replace('(', '').replace(')', '').split(',') if v.strip()]
    try:
        return tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else [value]))
    except (TypeError, ValueError):
        raise ConfigError(f'{field}={value!r} is invalid: allowed integers such as 1,2,3.') from None


def to_configdict(config: Config) -> ml_collections.ConfigDict:
    """The mutable form that configs/*.py return and the command line overrides."""
    return ml_collections.ConfigDict(dataclasses.asdict(config))


def from_configdict(config_dict: ml_collections.ConfigDict) -> Config:
    """Validates every field; raises ConfigError naming the first bad one."""
    values = config_dict.to_dict()
    sections = {}
    for field in dataclasses.fields(Config):
        section_cls = field.type if isinstance(field.type, type) else globals()[field.type]
        given = dict(values.pop(field.name, {}))
        known = {f.name: f for f in dataclasses.fields(section_cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ConfigError(f'{field.name}.{unknown[0]} is not a config field; allowed: {", ".join(sorted(known))}.')
        for name in given:  # tuples of ints from JSON lists or a command line's '1,3,5'
            if known[name].type == 'tuple[int, ...]':  # the annotation, a string here
                given[name] = _int_tuple(f'{field.name}.{name}', given[name])
        sections[field.name] = section_cls(**given)
    if values:
        raise ConfigError(
            f'{sorted(values)[0]} is not a config section; allowed: '
            f'{", ".join(f.name for f in dataclasses.fields(Config))}.'
        )
    return Config(**sections)
