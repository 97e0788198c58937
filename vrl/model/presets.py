"""Named variants: a value-residual variant or baseline with its options, applied to any model shape.

`apply('resformer:learnable_plus', cfg)` returns cfg with those model fields set. The names are
what `bench/train_throughput.py --variants=...` takes. Each preset follows the paper's setting
(docs/paper.md) or the public record it names; shape-dependent ones (sparse layers, GQA, value
embeddings) are derived from the model's layers and heads.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable

from vrl.core.config import ConfigError
from vrl.model.config import ModelConfig


def _late_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The last 3/8 of the layers (layers 6-8 of 8, as in the paper's sparse setting)."""
    count = max(1, round(3 * cfg.n_layers / 8))
    return tuple(range(cfg.n_layers - count + 1, cfg.n_layers + 1))


def _gqa(group: int) -> Callable[[ModelConfig], dict]:
    def overrides(cfg: ModelConfig) -> dict:
        if cfg.n_heads % group:
            raise ConfigError(f'GQA{group} needs model.n_heads divisible by {group}; it is {cfg.n_heads}.')
        return dict(n_kv_heads=cfg.n_heads // group)

    return overrides


def _half_of_the_value_heads(cfg: ModelConfig) -> dict:
    if cfg.n_kv_heads % 2:
        raise ConfigError(f'skipv1 takes half of the value heads: model.n_kv_heads must be even, not {cfg.n_kv_heads}.')
    return dict(skip_v1=cfg.n_kv_heads // 2)


def _eight_blocks_or_fewer(cfg: ModelConfig) -> dict:
    """Block AttnRes at the paper's ~8 blocks: the most blocks, at most 8, that split the layers evenly."""
    blocks = max(n for n in range(1, min(8, cfg.n_layers) + 1) if cfg.n_layers % n == 0)
    return dict(attention='vanilla', residual='attnres', attn_residual_blocks=blocks)


# name -> (what it is, the model fields it sets, given the base model config)
PRESETS: dict[str, tuple[str, Callable[[ModelConfig], dict]]] = {
    'vanilla': ('Llama-style baseline', lambda cfg: dict(attention='vanilla')),
    'resformer': (
        'ResFormer, lambda_1 = lambda_2 = 0.5 (the official code)',
        lambda cfg: dict(attention='resformer', lambda_mode='identity'),
    ),
    'resformer:constant': (
        'ResFormer, V_n + 2 V_1',
        lambda cfg: dict(attention='resformer', lambda_mode='constant', lambda1=2.0, lambda2=1.0),
    ),
    'resformer:learnable': (
        'ResFormer, both lambdas learned per layer (init 0.5)',
        lambda cfg: dict(attention='resformer', lambda_mode='learnable'),
    ),
    'resformer:learnable_plus': (
        "ResFormer, lambda_1 = s softmax(w) over layers (the paper's best)",
        lambda cfg: dict(attention='resformer', lambda_mode='learnable_plus'),
    ),
    'resformer:sparse': (
        'ResFormer, lambda_1 = 5 on the last 3/8 of the layers only',
        lambda cfg: dict(
            attention='resformer', lambda_mode='sparse', lambda1=5.0, lambda2=1.0, sparse_layers=_late_layers(cfg)
        ),
    ),
    'resformer:per_token': (
        'learned per-token mix, sigmoid(x W_mix) per kv head (x-transformers)',
        lambda cfg: dict(attention='resformer', lambda_mode='per_token'),
    ),
    'svformer': ('SVFormer: layers >= 2 attend over V_1, no W_V', lambda cfg: dict(attention='svformer')),
    'svformer:gqa4': (
        'SVFormer with 4 query heads per kv head',
        lambda cfg: dict(attention='svformer', **_gqa(4)(cfg)),
    ),
    'neutreno': (
        'NeuTRENO, + 0.4 (V_1 - V_n) on the attention output',
        lambda cfg: dict(attention='vanilla', neutreno=True, neutreno_lambda=0.4),
    ),
    'resformer+neutreno': (
        'ResFormer (identity) with NeuTRENO 0.2 on the mix: + 0.2 (V_1 - V_mix) = 0.1 (V_1 - V_n)',
        lambda cfg: dict(attention='resformer', lambda_mode='identity', neutreno=True, neutreno_lambda=0.2),
    ),
    'denseformer': (
        'DenseFormer: depth-weighted averages of all block outputs',
        lambda cfg: dict(attention='vanilla', residual='dense'),
    ),
    'cla2': ('cross-layer attention: layer pairs share K and V', lambda cfg: dict(attention='vanilla', kv_share=2)),
    'svformer+cla2': (
        'SVFormer with CLA2: V_1 once, layer pairs share keys',
        lambda cfg: dict(attention='svformer', kv_share=2),
    ),
    'skipv1': (
        "SkipV1Former: layers >= 2 take half of their value heads from layer 1's (the paper's)",
        lambda cfg: dict(attention='vanilla', **_half_of_the_value_heads(cfg)),
    ),
    'resformer+skipv1': (
        "SkipV1Former on ResFormer's mix (identity): half of layers >= 2's value heads from V_1, the rest mixed",
        lambda cfg: dict(attention='resformer', lambda_mode='identity', **_half_of_the_value_heads(cfg)),
    ),
    'gqa4': (
        'grouped-query attention, 4 query heads per kv head',
        lambda cfg: dict(attention='vanilla', **_gqa(4)(cfg)),
    ),
    'mqa': ('multi-query attention: one kv head', lambda cfg: dict(attention='vanilla', n_kv_heads=1)),
    'value_embeds': (
        'value embeddings on alternating layers 1, 3, ..., a table each (nanochat)',
        lambda cfg: dict(attention='vanilla', value_embed_layers=tuple(range(1, cfg.n_layers + 1, 2))),
    ),
    'resformer+value_embeds': (
        'ResFormer (learnable_plus) with value embeddings on alternating layers',
        lambda cfg: dict(
            attention='resformer', lambda_mode='learnable_plus', value_embed_layers=tuple(range(1, cfg.n_layers + 1, 2))
        ),
    ),
    'mudd': (
        "MUDD: the q, k, v and residual inputs each a dynamic mix of all earlier outputs (the authors')",
        lambda cfg: dict(attention='vanilla', residual='mudd', mudd_ways='qkvr'),
    ),
    'mudd:vr': (
        'MUDD on the values and the residual only',
        lambda cfg: dict(attention='vanilla', residual='mudd', mudd_ways='vr'),
    ),
    'mudd:r': (
        'MUDD on the residual only: a DenseFormer with weights made per position',
        lambda cfg: dict(attention='vanilla', residual='mudd', mudd_ways='r'),
    ),
    'mudd:vr_late': (
        'MUDD on the values and the residual after the last 3/8 of the layers (modded-nanogpt)',
        lambda cfg: dict(attention='vanilla', residual='mudd', mudd_ways='vr', mudd_layers=_late_layers(cfg)),
    ),
    'resformer+mudd': (
        'ResFormer (learnable_plus) with MUDD (qkvr): V_1 mixed into values that are themselves a mix',
        lambda cfg: dict(attention='resformer', lambda_mode='learnable_plus', residual='mudd', mudd_ways='qkvr'),
    ),
    'hc': (
        'hyper-connections: 4 residual streams, static + dynamic (tanh) weights per sublayer (Zhu et al.)',
        lambda cfg: dict(attention='vanilla', residual='hc'),
    ),
    'hc:static': (
        "hyper-connections with learned constant weights only (the paper's SHC)",
        lambda cfg: dict(attention='vanilla', residual='hc', hyper_dynamic=False),
    ),
    'mhc': (
        'manifold-constrained hyper-connections: 4 streams, doubly stochastic remix (DeepSeek)',
        lambda cfg: dict(attention='vanilla', residual='mhc'),
    ),
    'resformer+mhc': (
        'ResFormer (learnable_plus) with mHC: V_1 beside a widened residual stream',
        lambda cfg: dict(attention='resformer', lambda_mode='learnable_plus', residual='mhc'),
    ),
    'attnres': (
        "Attention Residuals: each sublayer's input a softmax over every earlier sublayer's output (Kimi team)",
        lambda cfg: dict(attention='vanilla', residual='attnres', attn_residual_blocks=0),
    ),
    'attnres:block': (
        'Block AttnRes: the softmax over blocks of layers (at most 8, evenly), each its outputs summed',
        _eight_blocks_or_fewer,
    ),
    'resformer+attnres': (
        'ResFormer (learnable_plus) with Attention Residuals: V_1 beside a softmax over depth',
        lambda cfg: dict(
            attention='resformer', lambda_mode='learnable_plus', residual='attnres', attn_residual_blocks=0
        ),
    ),
    'svformer+value_embeds': (
        'SVFormer with a value embedding on layer 1 (V_1, the values its layers >= 2 attend over)',
        lambda cfg: dict(attention='svformer', value_embed_layers=(1,)),
    ),
}


def apply(name: str, cfg: ModelConfig) -> ModelConfig:
    """cfg as the preset `name`: the variant fields reset to vanilla's, then the preset's set (the
    shape, GQA included, stays the base config's unless the preset names it)."""
    if name not in PRESETS:
        near = difflib.get_close_matches(name, PRESETS, n=2)
        named = f'did you mean {" or ".join(map(repr, near))}?' if near else f'allowed: {", ".join(PRESETS)}.'
        raise ConfigError(
            f'unknown variant preset {name!r}; {named} (python -m vrl.experiments.compare --list_variants lists '
            'the presets and what each is)'
        )
    return dataclasses.replace(cfg.as_vanilla(), **PRESETS[name][1](cfg))


def listing() -> str:
    """The presets, one per line: name and what it is."""
    width = max(map(len, PRESETS))
    return '\n'.join(f'{name:<{width}}  {description}' for name, (description, _) in PRESETS.items())
