"""The Hugging Face way out and in: vrl parameters <-> a Hugging Face model directory (safetensors).

Out (`python -m vrl.tools.export`): a vanilla model is a plain `LlamaForCausalLM`; every other variant
is a `VrlForCausalLM`, whose PyTorch code (vrl/interop/hf_modeling/, copied into the directory, loaded
with `trust_remote_code=True`) implements it with Llama's parameter names plus its own. Both
get model.safetensors (float32, the unpadded vocabulary) and the run's tokenizer (tokenizer.model
with a LlamaTokenizer config, or tokenizer.json with a fast-tokenizer config) that encodes exactly
as vrl's, starting every text with the separator vrl trained with: EOS).
In (`--init_from=hf:DIR`): a Llama directory, one vrl.tools.export wrote (any variant), or the paper's
official checkpoints (Llama names; SVFormer's layers >= 2 without v_proj). The tensors the
config's model needs are listed by `links`, and each is checked by name and shape.

Weights, vrl -> Hugging Face (D = d_model, H heads, K kv heads, Dh head_dim, F d_ff; layer i
is `first` for i = 0 and entry i - 1 of the stacked `layers` otherwise):
    wq (D, H, Dh) -> q_proj (H*Dh, D)    wk, wv (D, K, Dh) -> k_proj, v_proj (K*Dh, D)
    wo (H, Dh, D) -> o_proj (D, H*Dh)    w_gate, w_up (D, F) -> gate_proj, up_proj (F, D)
    w_down (F, D) -> down_proj (D, F)    norms' scale -> weight; embed (V', D) -> embed_tokens (V, D)
    head (D, V') -> lm_head (V, D), absent when tied.
    CLA: shared_kv.wk, wv (owners, D, K, Dh) -> the owning layers' k_proj, v_proj.
    per-token mix: w_mix (D, K) -> self_attn.mix_proj (K, D).
    value embeddings: tables (T, V', K, Dh) -> model.value_embeds.t (V, K*Dh); gates (entries, D, K)
        -> each such layer's self_attn.value_embed_gate (K, D).
    ResFormer's lambdas (v1, vn, w, s) -> model.value_lambdas.*; DenseFormer's alpha -> each
        layer's depth_weights (i + 2,), row i of its depth matrix.
    MUDD: w_in[n] (D, H), w_out[n] (H, C (i + 2)), static[n] (C, i + 2) of the n-th connection ->
        its layer's mudd.proj_in (H, D), mudd.proj_out (C (i + 2), H), mudd.static; the stacked layers'
        k_input_norm, v_input_norm scales -> their k_input_norm, v_input_norm.
    Hyper-connections: each layer's attn_hyper and mlp_hyper (static_pre, static_post, static_res, norm,
        w, gates) -> its attn_hyper.*, mlp_hyper.*, same names and shapes.
Both sides use rotate-half RoPE and x * rsqrt(mean(x^2) + eps) * weight: no permutation needed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from vrl.core.errors import CheckpointError
from vrl.data.tokenizer import SentencePieceTokenizer, Tokenizer
from vrl.model.cache import layout_of
from vrl.model.config import VARIANT_FIELDS, ModelConfig, before_residual, upgraded

try:
    from safetensors.numpy import load_file, save_file
except ImportError as e:
    raise ImportError(
        f'the Hugging Face export and import need safetensors ({e}): pip install -r requirements-extra.txt'
    ) from e

MODELING_DIR = Path(__file__).parent / 'hf_modeling'
# The transformers releases an export works with: requirements-extra.txt's range, whose lower
# bound requirements-oldest.txt pins for the tests; written into every export's model card.
TRANSFORMERS = 'transformers>=5.3.0'
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # buffers some Llama checkpoints carry; recomputed, not weights


class HFError(CheckpointError):
    """A model that cannot be exported, or a Hugging Face directory that does not fit; the message says what differs."""


class Link(NamedTuple):
    """One Hugging Face tensor and where it lives among vrl's parameters."""

    name: str  # the Hugging Face name
    path: tuple[str, ...]  # into vrl's parameter tree
    index: Any  # a NumPy index into that array: () for all of it
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]  # (tensor, the vrl shape)


_SAME = (lambda w: w, lambda t, s: t.reshape(s))
_TRANSPOSE = (lambda w: w.T, lambda t, s: t.T)
_INTO_LINEAR = (lambda w: w.reshape(w.shape[0], -1).T, lambda t, s: t.T.reshape(s))  # (D, ...) -> (prod, D)
_OUT_OF_LINEAR = (lambda w: w.reshape(-1, w.shape[-1]).T, lambda t, s: t.T.reshape(s))  # (..., D) -> (D, prod)
_FLAT_ROWS = (lambda w: w.reshape(w.shape[0], -1), lambda t, s: t.reshape(s))  # (V, K, Dh) -> (V, K*Dh)

_BLOCK_WEIGHTS = [  # (Hugging Face name within a layer, vrl (module, weight) within a block, transforms)
    ('self_attn.q_proj.weight', ('attn', 'wq'), _INTO_LINEAR),
    ('self_attn.o_proj.weight', ('attn', 'wo'), _OUT_OF_LINEAR),
    ('mlp.gate_proj.weight', ('mlp', 'w_gate'), _TRANSPOSE),
    ('mlp.up_proj.weight', ('mlp', 'w_up'), _TRANSPOSE),
    ('mlp.down_proj.weight', ('mlp', 'w_down'), _TRANSPOSE),
    ('input_layernorm.weight', ('attn_norm', 'scale'), _SAME),
    ('post_attention_layernorm.weight', ('mlp_norm', 'scale'), _SAME),
]


HYPER_WEIGHTS = ('static_pre', 'static_post', 'static_res', 'norm', 'w', 'gates')  # the static ones first
DEPTH_WEIGHTS = ('query', 'key_scale')  # attention residuals' DepthQuery


def is_llama(cfg: ModelConfig) -> bool:
    """Whether the model is a plain Llama decoder: vanilla attention, none of the baselines, no QK-norm."""
    return not (
        cfg.attention != 'vanilla'
        or cfg.neutreno
        or cfg.residual != 'plain'
        or cfg.skip_v1
        or cfg.kv_share > 1
        or cfg.value_embed_layers
        or cfg.qk_norm
        or cfg.attn_logits_soft_cap
        or cfg.final_logits_soft_cap
        or cfg.attention_window
    )


def links(cfg: ModelConfig) -> list[Link]:
    """Every tensor of the Hugging Face model for `cfg`, each tied to its place in vrl's parameters."""
    V = cfg.vocab_size
    out = [
        Link('model.embed_tokens.weight', ('embed',), np.s_[:V], *_SAME),
        Link('model.norm.weight', ('final_norm', 'scale'), (), *_SAME),
    ]
    if not cfg.tie_embeddings:
        out.append(Link('lm_head.weight', ('head',), np.s_[:, :V], *_TRANSPOSE))
    owns_kv = layout_of(cfg).owns_kv
    owners = [layer for layer in range(1, cfg.n_layers) if owns_kv(layer)]
    ve_entry = {layer - 1: entry for entry, layer in enumerate(cfg.value_embed_layers)}
    depth_offset = 0
    mudd_entry = {i: n for n, i in enumerate(i for i in range(cfg.n_layers) if cfg.mudd_after(i))}
    for i in range(cfg.n_layers):
        block, at = ('first', ()) if i == 0 else ('layers', (i - 1,))
        prefix = f'model.layers.{i}.'
        out += [Link(prefix + name, (block, *path), at, *fns) for name, path, fns in _BLOCK_WEIGHTS]
        if owns_kv(i):  # CLA keeps the stacked owners' W_K, W_V apart; SVFormer's layers >= 2 have no W_V
            path, kv_at = ((block, 'attn'), at) if i == 0 or cfg.kv_share == 1 else (('shared_kv',), (owners.index(i),))
            out.append(Link(prefix + 'self_attn.k_proj.weight', (*path, 'wk'), kv_at, *_INTO_LINEAR))
            if cfg.qk_norm:
                out.append(Link(prefix + 'self_attn.k_norm.weight', (*path, 'k_norm'), kv_at, *_SAME))
            if i == 0 or cfg.attention != 'svformer':
                out.append(Link(prefix + 'self_attn.v_proj.weight', (*path, 'wv'), kv_at, *_INTO_LINEAR))
        if cfg.qk_norm:
            out.append(Link(prefix + 'self_attn.q_norm.weight', (block, 'attn', 'q_norm'), at, *_SAME))
        if i > 0 and cfg.per_token_mix:
            out.append(Link(prefix + 'self_attn.mix_proj.weight', ('layers', 'attn', 'w_mix'), at, *_TRANSPOSE))
        if i in ve_entry:
            out.append(
                Link(
                    prefix + 'self_attn.value_embed_gate.weight', ('value_embeds', 'gates'), (ve_entry[i],), *_TRANSPOSE
                )
            )
        if cfg.residual == 'dense':  # row i of the depth matrix: its i + 2 weights, contiguous in alpha
            out.append(
                Link(
                    prefix + 'depth_weights',
                    ('depth_weights', 'alpha'),
                    np.s_[depth_offset : depth_offset + i + 2],
                    *_SAME,
                )
            )
            depth_offset += i + 2
        if i > 0:
            for way in cfg.mudd_ways[:-1].replace('q', '') if cfg.residual == 'mudd' else '':
                out.append(Link(f'{prefix}{way}_input_norm.weight', (block, f'{way}_input_norm', 'scale'), at, *_SAME))
        for sublayer in ('attn_hyper', 'mlp_hyper') if cfg.residual in ('hc', 'mhc') else ():
            names = HYPER_WEIGHTS if cfg.hyper_dynamic else HYPER_WEIGHTS[:3]
            out += [Link(f'{prefix}{sublayer}.{name}', (block, sublayer, name), at, *_SAME) for name in names]
        for sublayer in ('attn_depth', 'mlp_depth') if cfg.residual == 'attnres' else ():
            out += [Link(f'{prefix}{sublayer}.{name}', (block, sublayer, name), at, *_SAME) for name in DEPTH_WEIGHTS]
        if i in mudd_entry:
            n = mudd_entry[i]
            out += [
                Link(prefix + 'mudd.proj_in.weight', ('mudd', 'w_in', n), (), *_TRANSPOSE),
                Link(prefix + 'mudd.proj_out.weight', ('mudd', 'w_out', n), (), *_TRANSPOSE),
                Link(prefix + 'mudd.static', ('mudd', 'static', n), (), *_SAME),
            ]
    if cfg.residual == 'attnres':  # the output query over every source
        out += [Link(f'model.depth_output.{name}', ('depth_output', name), (), *_SAME) for name in DEPTH_WEIGHTS]
    for table in sorted(set(cfg.value_embed_table_ids)):
        out.append(
            Link(f'model.value_embeds.{table}.weight', ('value_embeds', 'tables'), np.s_[table, :V], *_FLAT_ROWS)
        )
    if cfg.attention == 'resformer' and cfg.lambda_mode in ('learnable', 'learnable_plus'):
        names = ('v1', 'vn') if cfg.lambda_mode == 'learnable' else ('vn', 'w', 's')
        out += [Link(f'model.value_lambdas.{name}', ('lambdas', name), (), *_SAME) for name in names]
    return out


def _at(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """vrl parameters (a pure dict of host arrays) -> Hugging Face tensors, float32, unpadded vocabulary."""
    return {
        link.name: np.array(link.to_hf(np.asarray(_at(params, link.path))[link.index]), np.float32, order='C')
        for link in links(cfg)
    }


_FIT_FIX = (
    "train the variant and shapes the weights were made with (their config.json's architecture and sizes), "
    'or leave --init_from out to start at random.'
)


def from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig, shapes: dict) -> dict:
    """Hugging Face tensors -> vrl parameters shaped like `shapes` (a pure dict of shapes; what no
    tensor fills, the vocabulary's padding, is zero). HFError names a missing, misshapen or unused tensor."""
    params = _zeros(shapes)
    expected = links(cfg)
    unused = set(tensors) - {link.name for link in expected}
    unused = sorted(name for name in unused if not name.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise HFError(
            f'the Hugging Face weights have {", ".join(map(repr, unused[:5]))}'
            f'{" and more" if len(unused) > 5 else ""}, which {cfg.variant_name} has no place for; {_FIT_FIX}'
        )
    for link in expected:
        target = _at(params, link.path)
        shape = target[link.index].shape
        hf_shape = link.to_hf(np.zeros(shape, np.float32)).shape
        if link.name not in tensors:
            raise HFError(f'the Hugging Face weights have no {link.name!r} ({cfg.variant_name} needs it); {_FIT_FIX}')
        if tensors[link.name].shape != hf_shape:
            raise HFError(
                f'{link.name} has shape {tensors[link.name].shape} but this config needs {hf_shape}; '
                f'{_value_heads_said(link.name, tensors[link.name].shape, cfg)}{_FIT_FIX}'
            )
        target[link.index] = link.from_hf(tensors[link.name].astype(np.float32), shape)
    return params


def _value_heads_said(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> str:
    """For a later layer's v_proj: the value heads SkipV1Former's model.skip_v1 leaves it and those the
    weights project ('' for any other tensor)."""
    if not name.endswith('self_attn.v_proj.weight') or name.startswith('model.layers.0.'):
        return ''
    K, heads = cfg.n_kv_heads, shape[0] // cfg.head_dim
    return (
        f'model.skip_v1={cfg.skip_v1} leaves layers >= 2 projecting {K - cfg.skip_v1} of {K} value heads; these '
        f'weights project {heads} (model.skip_v1={K - heads} would read them). '
    )


def _zeros(shapes: Any) -> Any:
    if hasattr(shapes, 'items'):  # a dict or an nnx.State of shape tuples
        return {key: _zeros(value) for key, value in shapes.items()}
    return np.zeros(shapes, np.float32)


# what a VrlForCausalLM's config.json adds to Llama's: vrl's names, with each residual method's switch as configs
# before model.residual spelled it (config.before_residual), which the plugin and earlier exports read
VRL_FIELDS = (*before_residual({**dict.fromkeys(VARIANT_FIELDS), 'residual': 'plain'}), 'qk_norm')
# and under transformers' names (Gemma 2's; None: off), config.json key -> vrl model field
_SOFT_CAP_FIELDS = {
    'attn_logit_softcapping': 'attn_logits_soft_cap',
    'final_logit_softcapping': 'final_logits_soft_cap',
}
_LLAMA_FIELDS = {  # Hugging Face config.json key -> vrl model field
    'hidden_size': 'd_model',
    'intermediate_size': 'd_ff',
    'num_hidden_layers': 'n_layers',
    'num_attention_heads': 'n_heads',
    'num_key_value_heads': 'n_kv_heads',
    'head_dim': 'head_dim',
    'rms_norm_eps': 'norm_eps',
    'tie_word_embeddings': 'tie_embeddings',
}


def hf_config(cfg: ModelConfig, max_positions: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """config.json: LlamaForCausalLM for a plain Llama decoder, vrl's VrlForCausalLM otherwise."""
    config = {key: getattr(cfg, field) for key, field in _LLAMA_FIELDS.items()}
    config.update(
        {
            'vocab_size': cfg.vocab_size,
            'hidden_act': 'silu',
            'max_position_embeddings': max_positions,
            'rope_theta': cfg.rope_theta,
            'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},
            'attention_bias': False,
            'mlp_bias': False,
            'bos_token_id': tokenizer.eos_id,
            'eos_token_id': tokenizer.eos_id,
            'pad_token_id': tokenizer.pad_id,
            'torch_dtype': 'float32',
        }
    )
    if is_llama(cfg):
        return {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', **config}
    variant = {field: _jsonable(value) for field, value in _export_fields(cfg).items()}
    variant.update({key: getattr(cfg, field) or None for key, field in _SOFT_CAP_FIELDS.items()})
    variant.update(_layer_types(cfg))
    return {
        'architectures': ['VrlForCausalLM'],
        'model_type': 'vrl',
        'auto_map': {
            'AutoConfig': 'configuration_vrl.VrlConfig',
            'AutoModel': 'modeling_vrl.VrlModel',
            'AutoModelForCausalLM': 'modeling_vrl.VrlForCausalLM',
        },
        **config,
        **variant,
    }


def _export_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The export's VRL_FIELDS of `cfg`; HFError for a residual method the export has no fields for."""
    fields = before_residual(dataclasses.asdict(cfg))
    if 'residual' in fields:
        raise HFError(
            f'model.residual={cfg.residual!r} has no Hugging Face export yet (the export writes the methods of '
            f'config.METHODS_BEFORE_RESIDUAL); train and evaluate it in vrl.'
        )
    return {field: fields[field] for field in VRL_FIELDS}


def _layer_types(cfg: ModelConfig) -> dict[str, Any]:
    """Local/global attention under transformers' names: sliding_window and layer_types."""
    kinds = ['sliding_attention' if local else 'full_attention' for local in cfg.local_layers]
    return {'sliding_window': cfg.attention_window or None, 'layer_types': kinds}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """The run's tokenizer file and a tokenizer config under which Hugging Face's tokenizer puts vrl's
    document separator (EOS) in front of every text: a LlamaTokenizer for a sentencepiece model; for
    a tokenizer.json, a fast tokenizer whose post-processor adds it."""
    eos, pad = tokenizer.piece(tokenizer.eos_id)[0], tokenizer.piece(tokenizer.pad_id)[0]
    if isinstance(tokenizer, SentencePieceTokenizer):
        (out / 'tokenizer.model').write_bytes(tokenizer.file_bytes)
        config = {
            'tokenizer_class': 'LlamaTokenizer',
            'legacy': True,
            'add_prefix_space': False,
            'add_bos_token': True,
            'add_eos_token': False,
            'unk_token': '<unk>',
        }
    else:
        rust = json.loads(tokenizer.file_bytes)
        rust['post_processor'] = {
            'type': 'TemplateProcessing',
            'single': [{'SpecialToken': {'id': eos, 'type_id': 0}}, {'Sequence': {'id': 'A', 'type_id': 0}}],
            'pair': [
                {'SpecialToken': {'id': eos, 'type_id': 0}},
                {'Sequence': {'id': 'A', 'type_id': 0}},
                {'Sequence': {'id': 'B', 'type_id': 1}},
            ],
            'special_tokens': {eos: {'id': eos, 'ids': [tokenizer.eos_id], 'tokens': [eos]}},
        }
        (out / 'tokenizer.json').write_text(json.dumps(rust, ensure_ascii=False))
        config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'split_special_tokens': True}  # text stays text
    (out / 'tokenizer_config.json').write_text(
        json.dumps(
            {**config, 'bos_token': eos, 'eos_token': eos, 'pad_token': pad, 'model_max_length': 1 << 30}, indent=2
        )
    )


def export(params: dict, cfg: ModelConfig, max_positions: int, tokenizer: Tokenizer, out: Path) -> list[Path]:
    """Writes the Hugging Face directory; returns its files."""
    tensors = to_hf(params, cfg)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / 'model.safetensors'), metadata={'format': 'pt'})
    write_checksums(out, ['model.safetensors'])
    (out / 'config.json').write_text(json.dumps(hf_config(cfg, max_positions, tokenizer), indent=2))
    (out / 'generation_config.json').write_text(
        json.dumps(
            {'bos_token_id': tokenizer.eos_id, 'eos_token_id': tokenizer.eos_id, 'pad_token_id': tokenizer.pad_id}
        )
    )
    if not is_llama(cfg):
        for name in ('configuration_vrl.py', 'modeling_vrl.py'):
            shutil.copyfile(MODELING_DIR / name, out / name)
    write_tokenizer(tokenizer, out)
    (out / 'README.md').write_text(model_card(cfg))
    return sorted(out.iterdir())


def write_checksums(out: Path, names: list[str]) -> None:
    """SHA256SUMS in sha256sum's format (`sha256sum -c SHA256SUMS` verifies it), which the vLLM plugin's
    check reads before serving."""
    lines = []
    for name in names:
        with (out / name).open('rb') as f:
            lines.append(f'{hashlib.file_digest(f, "sha256").hexdigest()}  {name}\n')
    (out / 'SHA256SUMS').write_text(''.join(lines))


def _unreadable(file: Path, e: Exception) -> HFError:
    return HFError(f'{file} cannot be read as safetensors ({" ".join(str(e).split())[:200]}): damaged?')


def verify_checksums(folder: Path) -> None:
    """The files that `folder`'s SHA256SUMS lists (an export's; a directory without one is not checked)
    against their recorded SHA-256: HFError naming the first that differs or is missing."""
    sums = folder / 'SHA256SUMS'
    if not sums.is_file():
        return
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition('  ')
        if not (folder / name).is_file():
            raise HFError(f'{folder / name}, listed in {sums}, is missing: the directory is incomplete.')
        with (folder / name).open('rb') as f:
            if hashlib.file_digest(f, 'sha256').hexdigest() != digest:
                raise HFError(
                    f"{folder / name}'s SHA-256 differs from the one {sums} records: the file was damaged or "
                    'replaced after the export (export the run again, or restore the file).'
                )


def model_card(cfg: ModelConfig) -> str:
    """README.md: what the directory holds and what loads it (the transformers range, remote code)."""
    llama = is_llama(cfg)
    loading = (
        'AutoModelForCausalLM.from_pretrained(path)'
        if llama
        else 'AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)'
    )
    kind = (
        'a plain `LlamaForCausalLM`'
        if llama
        else '`VrlForCausalLM`, whose PyTorch code (modeling_vrl.py, configuration_vrl.py) is in this directory'
    )
    return (
        f'---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [vrl, {cfg.attention}]\n---\n\n'
        f'# {cfg.variant_name}\n\n'
        f'A decoder trained with vrl (value residual learning, Zhou et al., arXiv 2410.17897), exported as {kind}.\n\n'
        f'Needs `{TRANSFORMERS}` and PyTorch. Load it with `{loading}` and '
        '`AutoTokenizer.from_pretrained(path)`.\n'
    )


def _check_config(hf: dict, folder: Path, cfg: ModelConfig) -> None:
    """HFError naming the first config.json field that differs from the vrl config."""
    hf = {
        'head_dim': hf['hidden_size'] // hf['num_attention_heads'],
        'num_key_value_heads': hf['num_attention_heads'],
        'tie_word_embeddings': False,
        **hf,
    }
    for key, field in _LLAMA_FIELDS.items():
        if hf.get(key) != getattr(cfg, field):
            raise HFError(
                f'{folder} has {key}={hf.get(key)!r} but the config has model.{field}='
                f'{getattr(cfg, field)!r}; set --config.model.{field}={hf.get(key)!r}.'
            )
    theta = (hf.get('rope_parameters') or {}).get('rope_theta', hf.get('rope_theta', 10_000.0))
    if theta != cfg.rope_theta:
        raise HFError(f'{folder} has rope_theta={theta!r} but the config has model.rope_theta={cfg.rope_theta!r}.')
    if hf['model_type'] == 'vrl':
        defaults, ours = _export_fields(ModelConfig()), _export_fields(cfg)
        for field in VRL_FIELDS:
            theirs = hf.get(field, _jsonable(defaults[field]))
            if theirs != _jsonable(ours[field]):
                fix = ' '.join(f'--config.model.{k}={v!r}' for k, v in upgraded({field: theirs}).items())
                named = (
                    f'model.{field}' if field in ModelConfig.__dataclass_fields__ else field
                )  # else an earlier switch
                raise HFError(f'{folder} has {field}={theirs!r} but the config has {named}={ours[field]!r}; set {fix}.')
        for key, field in _SOFT_CAP_FIELDS.items():
            theirs = hf.get(key) or 0.0
            if theirs != getattr(cfg, field):
                raise HFError(
                    f'{folder} has {key}={hf.get(key)!r} but the config has model.{field}='
                    f'{getattr(cfg, field)!r}; set --config.model.{field}={theirs!r}.'
                )
        window = hf.get('sliding_window') or 0
        kinds = hf.get('layer_types') or ['full_attention'] * cfg.n_layers
        global_layers = tuple(n for n, kind in enumerate(kinds, 1) if kind == 'full_attention') if window else ()
        if (window, global_layers) != (cfg.attention_window, cfg.global_layers):
            raise HFError(
                f'{folder} has sliding_window={hf.get("sliding_window")!r} and full_attention on layers '
                f'{list(global_layers)}, but the config has model.attention_window={cfg.attention_window} and '
                f'model.global_layers={cfg.global_layers}; set --config.model.attention_window={window} '
                f'--config.model.global_layers={",".join(map(str, global_layers))}.'
            )
    if hf['vocab_size'] > cfg.vocab_size:
        raise HFError(
            f'{folder} has vocab_size={hf["vocab_size"]} but model.vocab_size={cfg.vocab_size}: set '
            f'--config.model.vocab_size={hf["vocab_size"]} (or larger) and its tokenizer.'
        )


class Imported(NamedTuple):
    """What `load_params` read: the parameters, how many tensors, and a line for the log."""

    params: dict
    tensors: int
    note: str  # '' or why the tensors alone cannot tell which variant they were trained as


def plain_llama_for(path: str, cfg: ModelConfig) -> bool:
    """Whether DIR is a plain Llama (a vanilla model's tensors, model_type 'llama') and `cfg` another
    variant whose tensors differ: a start by uptraining (vrl/train/start.py) rather than a load."""
    folder = Path(path)
    config_file = folder / 'config.json'
    if not config_file.is_file() or json.loads(config_file.read_text()).get('model_type') != 'llama':
        return False
    from safetensors import safe_open

    verify_checksums(folder)
    names = set()
    for file in folder.glob('*.safetensors'):
        try:
            with safe_open(str(file), 'np') as f:
                names.update(name for name in f.keys() if not name.endswith(_IGNORED_SUFFIXES))
        except Exception as e:  # noqa: BLE001 - safetensors' own error for a header it cannot parse
            raise _unreadable(file, e) from None
    wanted = {link.name for link in links(cfg)}
    # SkipV1Former has vanilla's tensor names but fewer value heads in layers >= 2: uptraining pools them
    return (names != wanted or cfg.skip_v1 > 0) and names == {link.name for link in links(cfg.as_vanilla())}


def load_params(path: str, cfg: ModelConfig, shapes: dict) -> Imported:
    """A Hugging Face directory's weights as vrl parameters for `cfg`; HFError names what differs.

    A Llama directory (model_type 'llama') can start any variant whose tensors it holds: a plain
    Llama starts vanilla (or a ResFormer with fixed lambdas), the paper's SVFormer checkpoints lack
    v_proj in layers >= 2. A vrl.tools.export directory must match the variant field by field.
    """
    folder = Path(path)
    config_file = folder / 'config.json'
    if not config_file.is_file():
        raise HFError(
            f'{config_file} not found: --init_from=hf:DIR needs a Hugging Face model directory '
            '(config.json + *.safetensors).'
        )
    hf = json.loads(config_file.read_text())
    if hf.get('model_type') not in ('llama', 'vrl'):
        raise HFError(
            f'{folder} holds a {hf.get("model_type")!r} model ({hf.get("architectures")}); vrl can start '
            'from Llama models (model_type "llama") and from its own exports ("vrl") only.'
        )
    _check_config(hf, folder, cfg)
    files = sorted(folder.glob('*.safetensors'))
    if not files:
        raise HFError(f'no *.safetensors in {folder}: vrl reads safetensors weights only.')
    verify_checksums(folder)
    tensors = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as e:  # noqa: BLE001 - safetensors' own error for a header or data it cannot parse
            raise _unreadable(file, e) from None
    vocab = hf['vocab_size']
    for name, tensor in tensors.items():  # a smaller vocabulary fits: pad its rows
        if name in ('model.embed_tokens.weight', 'lm_head.weight') or name.startswith('model.value_embeds.'):
            if tensor.shape[0] == vocab < cfg.vocab_size:
                pad = np.zeros((cfg.vocab_size - vocab, *tensor.shape[1:]), tensor.dtype)
                tensors[name] = np.concatenate([tensor, pad])
    params = from_hf(tensors, cfg, shapes)
    return Imported(
        params, sum(not name.endswith(_IGNORED_SUFFIXES) for name in tensors), _ambiguity(hf['model_type'], cfg)
    )


def _ambiguity(model_type: str, cfg: ModelConfig) -> str:
    """A plain Llama config.json does not say which variant trained the weights; where the tensor
    set fits vanilla too (ResFormer with fixed lambdas: no tensors of its own), the config decides."""
    if model_type != 'llama':
        return ''
    if is_llama(cfg):
        return (
            'a plain Llama config.json: these tensors also fit a fixed-lambda ResFormer; an official-code '
            'ResFormer checkpoint needs --config.model.attention=resformer'
        )
    if {link.name for link in links(cfg)} == {link.name for link in links(cfg.as_vanilla())}:
        return (
            f'WARNING: a plain Llama config.json whose tensors fit vanilla too: started as {cfg.variant_name} '
            'because the config says so; if these weights were trained as vanilla, their logits will differ'
        )
    return ''


def run_tokenizer(path: str, named: str) -> tuple[str, str]:
    """The tokenizer a run started from hf:DIR must train with, and a line for the log.

    The weights' own DIR/tokenizer.model or DIR/tokenizer.json (in that order), or `named`
    (data.tokenizer) after checking that it has the same pieces. HFError naming both and their first
    difference when they disagree, or when DIR has neither and none is named (a tokenizer trained
    for the run would feed these weights ids they never saw).
    """
    theirs = next(
        (Path(path) / name for name in ('tokenizer.model', 'tokenizer.json') if (Path(path) / name).is_file()), None
    )
    if named and theirs is None:
        return (
            named,
            f'tokenizer {named} (data.tokenizer; {path} has no tokenizer.model or tokenizer.json to check it against)',
        )
    if named:
        difference = Tokenizer.load(named).difference(Tokenizer.load(str(theirs)))
        if difference:
            raise HFError(
                f'data.tokenizer={named} is not the tokenizer the weights in {path} were trained with '
                f'({theirs}): {difference}. Leave data.tokenizer empty to train with theirs.'
            )
        return named, f'tokenizer {named} (data.tokenizer, the same pieces as {theirs})'
    if theirs is None:
        other = ', '.join(p.name for p in sorted(Path(path).glob('tokenizer*')))
        raise HFError(
            f'{path} has no tokenizer.model or tokenizer.json{f" (only {other})" if other else ""}'
            ': a tokenizer trained for this run would feed these weights ids they never saw. Name the '
            'tokenizer they were trained with: --config.data.tokenizer=PATH.'
        )
    return str(theirs), f'tokenizer {theirs}'
