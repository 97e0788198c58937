"""The Hugging Face way out and in: vrl parameters <-> a Llama model directory (safetensors).

Out (`python -m vrl.export`): config.json for `LlamaForCausalLM`, model.safetensors (float32,
the unpadded vocabulary), and the tokenizer (tokenizer.model + tokenizer_config.json for
transformers' LlamaTokenizer, which encodes exactly as vrl's sentencepiece model does, and
starts every text with the separator vrl trained with: EOS).
In (`--init_from=hf:DIR`): a Llama directory of the same shape, checked name by name.

Only models that are plain Llama decoders go through this file: vanilla attention, none of the
baselines. ResFormer, SVFormer and the others need a modeling file of vrl's own (#17, not yet).

Weights, vrl -> Llama (D = d_model, H heads, K kv heads, Dh head_dim, F d_ff):
    wq (D, H, Dh) -> q_proj (H*Dh, D)    wk, wv (D, K, Dh) -> k_proj, v_proj (K*Dh, D)
    wo (H, Dh, D) -> o_proj (D, H*Dh)    w_gate, w_up (D, F) -> gate_proj, up_proj (F, D)
    w_down (F, D) -> down_proj (D, F)    norms' scale -> weight; embed (V', D) -> embed_tokens (V, D)
    head (D, V') -> lm_head (V, D), absent when tied.
Both use rotate-half RoPE and x * rsqrt(mean(x^2) + eps) * weight, so no permutation is needed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vrl.checkpoint import CheckpointError
from vrl.config import ModelConfig
from vrl.tokenizer import Tokenizer

try:
    from safetensors.numpy import load_file, save_file
except ImportError as e:
    raise ImportError(f'the Hugging Face export and import need safetensors ({e}): '
                      'pip install -r requirements-extra.txt') from e


class HFError(CheckpointError):
    """A model that cannot be exported, or a Hugging Face directory that does not fit; the message says what differs."""


# (Llama name within a layer, vrl path within a block, vrl -> Llama, Llama -> vrl given the vrl shape)
_LAYER_WEIGHTS: list[tuple[str, tuple[str, str], Callable, Callable]] = [
    ('self_attn.q_proj.weight', ('attn', 'wq'), lambda w: w.reshape(w.shape[0], -1).T, lambda t, s: t.T.reshape(s)),
    ('self_attn.k_proj.weight', ('attn', 'wk'), lambda w: w.reshape(w.shape[0], -1).T, lambda t, s: t.T.reshape(s)),
    ('self_attn.v_proj.weight', ('attn', 'wv'), lambda w: w.reshape(w.shape[0], -1).T, lambda t, s: t.T.reshape(s)),
    ('self_attn.o_proj.weight', ('attn', 'wo'), lambda w: w.reshape(-1, w.shape[-1]).T, lambda t, s: t.T.reshape(s)),
    ('mlp.gate_proj.weight', ('mlp', 'w_gate'), lambda w: w.T, lambda t, s: t.T),
    ('mlp.up_proj.weight', ('mlp', 'w_up'), lambda w: w.T, lambda t, s: t.T),
    ('mlp.down_proj.weight', ('mlp', 'w_down'), lambda w: w.T, lambda t, s: t.T),
    ('input_layernorm.weight', ('attn_norm', 'scale'), lambda w: w, lambda t, s: t),
    ('post_attention_layernorm.weight', ('mlp_norm', 'scale'), lambda w: w, lambda t, s: t),
]


def check_exportable(cfg: ModelConfig) -> None:
    """HFError unless the model is a plain Llama decoder."""
    if cfg.attention != 'vanilla' or cfg.neutreno or cfg.denseformer or cfg.kv_share > 1 or cfg.value_embed_layers:
        raise HFError(f'{cfg.variant_name} is not a plain Llama decoder: only vanilla models (any GQA/MQA) '
                      'export as LlamaForCausalLM so far; the value-residual variants need a modeling file of '
                      "vrl's own, which does not exist yet.")


def llama_config(cfg: ModelConfig, max_positions: int, tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': cfg.vocab_size,
        'hidden_size': cfg.d_model, 'intermediate_size': cfg.d_ff, 'num_hidden_layers': cfg.n_layers,
        'num_attention_heads': cfg.n_heads, 'num_key_value_heads': cfg.n_kv_heads, 'head_dim': cfg.head_dim,
        'hidden_act': 'silu', 'max_position_embeddings': max_positions, 'rms_norm_eps': cfg.norm_eps,
        'rope_theta': cfg.rope_theta, 'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},
        'tie_word_embeddings': cfg.tie_embeddings, 'attention_bias': False, 'mlp_bias': False,
        'bos_token_id': tokenizer.eos_id, 'eos_token_id': tokenizer.eos_id, 'pad_token_id': tokenizer.pad_id,
        'torch_dtype': 'float32',
    }


def _layer(params: dict, i: int) -> Callable[[tuple[str, str]], np.ndarray]:
    """Layer i's weight at a (module, name) path: layer 0 is `first`, the rest are slices of the stack."""
    if i == 0:
        return lambda path: np.asarray(params['first'][path[0]][path[1]])
    return lambda path: np.asarray(params['layers'][path[0]][path[1]][i - 1])


def to_llama(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """vrl parameters (a pure dict of host arrays) -> Llama tensors, float32, unpadded vocabulary."""
    check_exportable(cfg)
    V = cfg.vocab_size
    tensors = {'model.embed_tokens.weight': np.asarray(params['embed'])[:V],
               'model.norm.weight': np.asarray(params['final_norm']['scale'])}
    if not cfg.tie_embeddings:
        tensors['lm_head.weight'] = np.asarray(params['head'])[:, :V].T
    for i in range(cfg.n_layers):
        weight = _layer(params, i)
        for name, path, out, _ in _LAYER_WEIGHTS:
            tensors[f'model.layers.{i}.{name}'] = out(weight(path))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}


def from_llama(tensors: dict[str, np.ndarray], cfg: ModelConfig, shapes: dict) -> dict:
    """Llama tensors -> vrl parameters shaped like `shapes` (a pure dict of shapes; vocab padded
    with zero rows); HFError names a missing or misshapen weight."""
    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise HFError(f'the Hugging Face weights have no {name!r}.')
        if tensors[name].shape != shape:
            raise HFError(f'{name} has shape {tensors[name].shape} but this config needs {shape}.')
        return tensors[name].astype(np.float32)

    V, D = cfg.vocab_size, cfg.d_model
    params: dict = {'final_norm': {'scale': get('model.norm.weight', (D,))}}
    params['embed'] = np.zeros(shapes['embed'], np.float32)
    params['embed'][:V] = get('model.embed_tokens.weight', (V, D))
    if not cfg.tie_embeddings:
        params['head'] = np.zeros(shapes['head'], np.float32)
        params['head'][:, :V] = get('lm_head.weight', (V, D)).T
    for block in ('first', 'layers'):
        params[block] = {module: {name: np.zeros(shape, np.float32) for name, shape in names.items()}
                         for module, names in shapes[block].items()}
    for i in range(cfg.n_layers):
        for name, (module, weight), out, back in _LAYER_WEIGHTS:
            shape = shapes['first'][module][weight] if i == 0 else shapes['layers'][module][weight][1:]
            expected = out(np.zeros(shape, np.float32)).shape
            value = back(get(f'model.layers.{i}.{name}', expected), shape)
            if i == 0:
                params['first'][module][weight] = value
            else:
                params['layers'][module][weight][i - 1] = value
    return params


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.model and a LlamaTokenizer config that adds vrl's document separator (EOS) in front."""
    shutil.copyfile(tokenizer.path, out / 'tokenizer.model')
    (out / 'tokenizer_config.json').write_text(json.dumps({
        'tokenizer_class': 'LlamaTokenizer', 'legacy': True, 'add_prefix_space': False,
        'add_bos_token': True, 'add_eos_token': False, 'bos_token': '</s>', 'eos_token': '</s>',
        'unk_token': '<unk>', 'pad_token': '<pad>', 'model_max_length': 1 << 30}, indent=2))


def export(params: dict, cfg: ModelConfig, max_positions: int, tokenizer: Tokenizer, out: Path) -> list[Path]:
    """Writes the Hugging Face directory; returns its files."""
    tensors = to_llama(params, cfg)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / 'model.safetensors'), metadata={'format': 'pt'})
    (out / 'config.json').write_text(json.dumps(llama_config(cfg, max_positions, tokenizer), indent=2))
    (out / 'generation_config.json').write_text(json.dumps({
        'bos_token_id': tokenizer.eos_id, 'eos_token_id': tokenizer.eos_id, 'pad_token_id': tokenizer.pad_id}))
    write_tokenizer(tokenizer, out)
    return sorted(out.iterdir())


_CONFIG_FIELDS = {  # Llama config.json key -> vrl model field
    'hidden_size': 'd_model', 'intermediate_size': 'd_ff', 'num_hidden_layers': 'n_layers',
    'num_attention_heads': 'n_heads', 'num_key_value_heads': 'n_kv_heads', 'head_dim': 'head_dim',
    'rms_norm_eps': 'norm_eps', 'tie_word_embeddings': 'tie_embeddings',
}


def load_params(path: str, cfg: ModelConfig, shapes: dict) -> dict:
    """A Hugging Face Llama directory's weights as vrl parameters for `cfg`; HFError names what differs."""
    folder = Path(path)
    config_file = folder / 'config.json'
    if not config_file.is_file():
        raise HFError(f'{config_file} not found: --init_from=hf:DIR needs a Hugging Face model directory '
                      '(config.json + *.safetensors).')
    hf = json.loads(config_file.read_text())
    if hf.get('model_type') != 'llama':
        raise HFError(f'{folder} holds a {hf.get("model_type")!r} model ({hf.get("architectures")}); vrl can start '
                      'from Llama models (model_type "llama") only.')
    check_exportable(cfg)
    hf.setdefault('head_dim', hf['hidden_size'] // hf['num_attention_heads'])
    hf.setdefault('num_key_value_heads', hf['num_attention_heads'])
    hf.setdefault('tie_word_embeddings', False)
    for key, field in _CONFIG_FIELDS.items():
        if hf.get(key) != getattr(cfg, field):
            raise HFError(f'{folder} has {key}={hf.get(key)!r} but the config has model.{field}='
                          f'{getattr(cfg, field)!r}; set --config.model.{field}={hf.get(key)!r}.')
    theta = (hf.get('rope_parameters') or {}).get('rope_theta', hf.get('rope_theta', 10_000.0))
    if theta != cfg.rope_theta:
        raise HFError(f'{folder} has rope_theta={theta!r} but the config has model.rope_theta={cfg.rope_theta!r}.')
    if hf['vocab_size'] > cfg.vocab_size:
        raise HFError(f'{folder} has vocab_size={hf["vocab_size"]} but model.vocab_size={cfg.vocab_size}: set '
                      f'--config.model.vocab_size={hf["vocab_size"]} (or larger) and its tokenizer.')
    files = sorted(folder.glob('*.safetensors'))
    if not files:
        raise HFError(f'no *.safetensors in {folder}: vrl reads safetensors weights only.')
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    vocab = hf['vocab_size']
    for name in ('model.embed_tokens.weight', 'lm_head.weight'):  # a smaller vocabulary fits: pad its rows
        if name in tensors and tensors[name].shape[0] == vocab < cfg.vocab_size:
            tensors[name] = np.concatenate([tensors[name], np.zeros((cfg.vocab_size - vocab, cfg.d_model),
                                                                    tensors[name].dtype)])
    return from_llama(tensors, cfg, shapes)
