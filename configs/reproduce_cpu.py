"""The CPU-scale reproduction of the paper's claims (docs/reproduction.md): 8 layers, about 27
minutes for 6 variants x 2 seeds on 2 CPU cores with `python -m vrl.experiments.compare`.

Why this size: the paper's effects grow with depth (V_1 matters more the more layers sit above
it), so the model is the tiny demo's (configs/tiny.py: d_model 128, 4 heads of 32, SwiGLU 384)
at the 82M config's 8 layers, with half its batch, so that one run of 400 steps x 16 x 128
tokens (0.8M tokens, about half an epoch of the embedded Shakespeare corpus with a 1024-piece
tokenizer) takes under 4 minutes. The recipe is the paper's (AdamW 0.9/0.95, weight decay 0.1, clipping 1, warmup then
cosine to a tenth), with the tiny demo's higher peak LR for this width.
`configs/reproduce_cpu.py:svformer` (or any preset of vrl/model/presets.py, alone or after the
recipe: `configs/reproduce_cpu.py:muon,attnres`) sets a variant for a single run.
`configs/reproduce_cpu.py:muon` is the same under vrl/train/optimizer.py's Muon + wsd recipe, and
`configs/reproduce_cpu.py:modern` under Muon + wsd with configs/modern.py's model fields, the window
a quarter of the sequence (32 tokens; layers 4 and 8 global) and value embeddings on layers 1, 3,
5, 7. compare and study set each variant's own fields from its preset (value embeddings among
them), so the recipe's comparison names the presets with them: `value_embeds`,
`resformer+value_embeds`, `svformer+value_embeds`.
"""

import dataclasses

import ml_collections

from configs import modern, tiny
from vrl.model import presets
from vrl.train import config as vrl_config
from vrl.train import optimizer


def get_config(arg: str = 'adamw') -> ml_collections.ConfigDict:
    """arg: 'RECIPE[,PRESET]' or 'PRESET': the recipe an optimizer recipe (adamw, muon) or `modern` (Muon +
    wsd and configs/modern.py's fields), default adamw; the preset one of vrl/model/presets.py's."""
    first, _, preset = arg.partition(',')
    recipe = first if first in (*optimizer.RECIPES, 'modern') else 'adamw'
    preset = preset or (first if recipe != first else 'vanilla')
    optimizer_name = 'muon' if recipe == 'modern' else recipe
    demo = tiny.config()
    config = dataclasses.replace(
        demo,
        model=presets.apply(preset, dataclasses.replace(demo.model, n_layers=8)),
        data=dataclasses.replace(demo.data, batch_size=16),
        train=dataclasses.replace(demo.train, eval_every=50, eval_batches=16, sample_tokens=0),
    )
    model = modern.modern(config.model, window=config.data.seq_len // 4) if recipe == 'modern' else config.model
    return vrl_config.to_configdict(
        dataclasses.replace(config, model=model, optimizer=optimizer.recipe(config.optimizer, optimizer_name))
    )
