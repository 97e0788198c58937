"""AdamW with global-norm clipping and linear warmup + cosine decay (docs/paper.md's recipe)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from vrl.config import OptimizerConfig

# RMSNorm weights (leaf 'scale'), ResFormer's lambdas and DenseFormer's averaging weights
_NOT_DECAYED = ('scale', 'lambdas', 'depth_weights')


def learning_rate(cfg: OptimizerConfig) -> optax.Schedule:
    """init_lr -> peak_lr linearly over warmup_steps, then cosine to final_lr at decay_steps."""
    return optax.warmup_cosine_decay_schedule(init_value=cfg.init_lr, peak_value=cfg.peak_lr,
                                              warmup_steps=cfg.warmup_steps, decay_steps=cfg.decay_steps,
                                              end_value=cfg.final_lr)


def weight_decay_mask(params: Any) -> Any:
    """True for parameters that are decayed: every weight matrix and the embeddings."""
    def decayed(path, _):
        keys = {getattr(k, 'key', None) for k in path}
        return not keys & set(_NOT_DECAYED)
    return jax.tree_util.tree_map_with_path(decayed, params)


def make(cfg: OptimizerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=weight_decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw
