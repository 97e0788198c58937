"""A tiny model on the embedded Shakespeare corpus: the CPU demo and the tests' shape.

`--config=configs/tiny.py:svformer` picks the variant, any preset of vrl/model/presets.py
(`configs/tiny.py:attnres:block`, `:skipv1`; default vanilla). Trains in a few minutes on 2 CPU
cores; the tokenizer and the TFDS dataset are built on first use.
"""

import dataclasses

import ml_collections

from vrl.model import presets
from vrl.train import config as vrl_config


def config(preset: str = 'vanilla') -> vrl_config.Config:
    """The tiny demo's config as the variant `preset` (configs/reproduce_cpu.py builds on it)."""
    demo = vrl_config.Config(
        model=vrl_config.ModelConfig(
            vocab_size=1024,
            vocab_pad_multiple=128,
            n_layers=4,
            d_model=128,
            n_heads=4,
            n_kv_heads=4,
            head_dim=32,
            d_ff=384,
            compute_dtype='float32',
        ),
        data=vrl_config.DataConfig(name='shakespeare', seq_len=128, batch_size=32),
        optimizer=vrl_config.OptimizerConfig(peak_lr=3e-3, final_lr=3e-4, warmup_steps=30),
        train=vrl_config.TrainConfig(
            steps=400, log_every=20, eval_every=200, eval_batches=8, checkpoint_every=200, sample_tokens=48
        ),
    )
    return dataclasses.replace(demo, model=presets.apply(preset, demo.model))


def get_config(preset: str = 'vanilla') -> ml_collections.ConfigDict:
    return vrl_config.to_configdict(config(preset))
