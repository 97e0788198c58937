"""Float32 parameters with logical axis names (vrl/sharding.py maps the names onto the mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float,
           stack: int | None = None) -> nnx.Param:
    """An N(0, std) weight; `stack` prepends a `layers` axis of that size."""
    if stack is not None:
        shape, axes = (stack, *shape), ('layers', *axes)
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def constant(value: jax.Array, axes: tuple[str | None, ...], stack: int | None = None) -> nnx.Param:
    """A weight initialised to `value` (broadcast over a leading `layers` axis of size `stack`)."""
    value = jnp.asarray(value, jnp.float32)
    if stack is not None:
        value, axes = jnp.broadcast_to(value, (stack, *value.shape)), ('layers', *axes)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)
