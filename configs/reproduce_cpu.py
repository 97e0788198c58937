"""The CPU-scale reproduction of the paper's claims (docs/reproduction.md): 8 layers, about 45
minutes for 6 variants x 2 seeds on 2 CPU cores with `python -m vrl.experiments.compare`.

Why this size: the paper's effects grow with depth (V_1 matters more the more layers sit above
it), so the model keeps the 82M config's 8 layers and shrinks the width (d_model 128, 4 heads of
32, SwiGLU 384) and the batch until one run of 400 steps x 16 x 128 tokens (0.8M tokens, about
half an epoch of the embedded Shakespeare corpus with a 1024-piece tokenizer) takes under 4
minutes. The recipe is the paper's (AdamW 0.9/0.95, weight decay 0.1, clipping 1, warmup then
cosine to a tenth), with the tiny demo's higher peak LR for this width.
`configs/reproduce_cpu.py:muon` is the same under vrl/train/optimizer.py's Muon + wsd recipe.
"""

import dataclasses

import ml_collections

from vrl.core import config as vrl_config
from vrl.train import optimizer


def get_config(optimizer_name: str = 'adamw') -> ml_collections.ConfigDict:
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
    return vrl_config.to_configdict(
        dataclasses.replace(config, optimizer=optimizer.recipe(config.optimizer, optimizer_name))
    )
