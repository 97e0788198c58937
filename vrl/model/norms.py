"""The blocks' RMSNorm: x / RMS(x) over d_model (float32 inside) times a learned scale (D,), one at init."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis
from vrl.model import ops, params
from vrl.model.config import ModelConfig


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, stack: int | None):
        self.scale = params.constant(np.ones(cfg.d_model), (Axis.EMBED,), stack)
        self.eps = cfg.norm_eps

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x = ops.rms_normalized(x_BxLxD, self.eps)
        return (x * self.scale[...][None, None, :]).astype(x_BxLxD.dtype)
