"""The CPU-scale reproduction of the paper's claims (docs/reproduction.md): 8 layers, about 27
minutes for 6 variants x 2 seeds on 2 CPU cores with `python -m vrl.experiments.compare`.

Why this size: the paper's effects grow with depth (V_1 matters more the more layers sit above
it), so the model keeps the 82M config's 8 layers and shrinks the width (d_model 128, 4 heads of
32, SwiGLU 384) and the batch until one run of 400 steps x 16 x 128 tokens (0.8M tokens, about
half an epoch of the embedded Shakespeare corpus with a 1024-piece tokenizer) takes under 4
minutes. The recipe is the paper's (AdamW 0.9/0.95, weight decay 0.1, clipping 1, warmup then
cosine to a tenth), with the tiny demo's higher peak LR for this width.
`configs/reproduce_cpu.py:muon` is the same under vrl/train/optimizer.py's Muon + wsd recipe, and
`configs/reproduce_cpu.py:modern` under Muon + wsd with configs/modern.py's model fields, the window
a quarter of the sequence (32 tokens; layers 4 and 8 global) and value embeddings on layers 1, 3,
5, 7. compare and study set each variant's own fields from its preset (value embeddings among
them), so the recipe's comparison names the presets with them: `value_embeds`,
`resformer+value_embeds`, `svformer+value_embeds`.
"""

import dataclasses

import ml_collections

from configs import modern
from vrl.core import config as vrl_config
from vrl.train import optimizer


def get_config(recipe: str = 'adamw') -> ml_collections.ConfigDict:
    """recipe: an optimizer recipe (adamw, muon) or `modern` (Muon + wsd and configs/modern.py's fields)."""
    optimizer_name = 'muon' if recipe == 'modern' else recipe
    config = vrl_config.Config(
        model=vrl_config.ModelConfig(
            vocab_size=1024,
            vocab_pad_multiple=128,
            n_layers=8,
            d_model=128,
            n_heads=4,
            n_kv_heads=4,
            head_dim=32,
            d_ff=384,
            compute_dtype='float32',
        ),
        data=vrl_config.DataConfig(name='shakespeare', seq_len=128, batch_size=16),
        optimizer=vrl_config.OptimizerConfig(peak_lr=3e-3, final_lr=3e-4, warmup_steps=30),
        train=vrl_config.TrainConfig(
            steps=400, log_every=20, eval_every=50, eval_batches=16, checkpoint_every=200, sample_tokens=0
        ),
    )
    model = modern.modern(config.model, window=config.data.seq_len // 4) if recipe == 'modern' else config.model
    return vrl_config.to_configdict(
        dataclasses.replace(config, model=model, optimizer=optimizer.recipe(config.optimizer, optimizer_name))
    )
