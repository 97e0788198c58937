"""The 2026 recipe around the variants, at one of base.py's sizes: `configs/modern.py:svformer,82m`.

base.py's shape and data at 2,048 tokens with Muon + WSD (optimizer.RECIPES['muon']), and:
- QK-norm (Qwen3 / Gemma 3 form, model.qk_norm);
- a soft cap of 15 on the final logits (nanochat); none on the attention logits, as nanochat (Gemma 2
  caps them at 50: --config.model.attn_logits_soft_cap=50; cuDNN through JAX has no such cap, so on a
  GPU it would leave the XLA path to attention);
- local/global layers: a 512-token window (a quarter of the sequence) in every layer but each
  fourth, which attends over the whole sequence (4 and 8 of the 82M; 4, 8, ..., 24 of the 468M);
- value embeddings on alternating layers 1, 3, 5, ... (nanochat; SVFormer: layer 1, the only one
  whose values it projects).
The variant is any preset of vrl/model/presets.py; `resformer` here means the preset
`resformer:learnable_plus` (the recipe's ResFormer).
"""

import dataclasses

import ml_collections

from configs import base
from vrl.model import presets
from vrl.train import config as vrl_config

WINDOW = 512
GLOBAL_EVERY = 4  # every fourth layer is global
FINAL_SOFT_CAP = 15.0
PRESET = {'vanilla': 'vanilla', 'resformer': 'resformer:learnable_plus', 'svformer': 'svformer'}


def modern(model: vrl_config.ModelConfig, window: int = WINDOW) -> vrl_config.ModelConfig:
    """`model` (a variant at some shape) with the recipe's fields, local layers attending over `window`."""
    every_other = tuple(range(1, model.n_layers + 1, 2))
    return dataclasses.replace(
        model,
        qk_norm=True,
        final_logits_soft_cap=FINAL_SOFT_CAP,
        attention_window=window,
        global_layers=tuple(range(GLOBAL_EVERY, model.n_layers + 1, GLOBAL_EVERY)),
        value_embed_layers=(1,) if model.attention == 'svformer' else every_other,
    )


def get_config(arg: str = 'svformer,82m') -> ml_collections.ConfigDict:
    """arg: 'PRESET,SIZE', PRESET one of vrl/model/presets.py's; SIZE one of base.py's."""
    variant, _, size = arg.partition(',')
    if size not in base.SIZES:
        raise vrl_config.ConfigError(
            f'configs/modern.py:{arg} is invalid: allowed PRESET,SIZE with SIZE one of {", ".join(base.SIZES)}.'
        )
    config = vrl_config.from_configdict(base.get_config(f'vanilla,{size},2k,muon'))
    model = modern(presets.apply(PRESET.get(variant, variant), config.model))
    return vrl_config.to_configdict(dataclasses.replace(config, model=model))
