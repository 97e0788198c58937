"""Float32 parameters with logical axis names (vrl/core/sharding.py maps the names onto the mesh).

Built eagerly (outside jit), a model should compile almost nothing: XLA compiles a program per
operation and shape, and a threefry draw takes a second or more on a CPU. So normal weights are
drawn in blocks of BLOCK values, one key per block, and cut to shape: a model compiles one draw
per block count (one for every weight under BLOCK values) and the values are the same under jit.
Cutting, scaling and constants are NumPy on the host unless traced.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis

BLOCK = 1 << 16


def scaled_normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """N(0, std) float32 values of `shape`: std times the first prod(shape) of ceil(prod / BLOCK) blocks."""
    n = math.prod(shape)
    blocks = jax.vmap(lambda k: jax.random.normal(k, (BLOCK,), jnp.float32))(jax.random.split(key, -(-n // BLOCK)))
    if isinstance(blocks, jax.core.Tracer):
        return jnp.float32(std) * blocks.reshape(-1)[:n].reshape(shape)
    return jnp.asarray(np.float32(std) * np.asarray(blocks).reshape(-1)[:n].reshape(shape))


def normal(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float, stack: int | None = None
) -> nnx.Param:
    """An N(0, std) weight; `stack` prepends a `layers` axis of that size."""
    if stack is not None:
        shape, axes = (stack, *shape), (Axis.LAYERS, *axes)
    value = scaled_normal(rngs.params(), shape, std)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def constant(value: np.ndarray | float, axes: tuple[str | None, ...], stack: int | None = None) -> nnx.Param:
    """A weight initialised to `value` (broadcast over a leading `layers` axis of size `stack`)."""
    value = np.asarray(value, np.float32)
    if stack is not None:
        value, axes = np.broadcast_to(value, (stack, *value.shape)), (Axis.LAYERS, *axes)
    return nnx.Param(jnp.asarray(value), out_sharding=axes, eager_sharding=False)
