"""A layer scan whose carry holds a depth history, with a backward pass that keeps the history once.

DenseFormer's and MUDD's layers read every earlier block output (attention residuals' sublayers every
completed source), so the layer scan carries them as a buffer (J, B, L, D) that step i only appends to.
`jax.lax.scan`'s backward pass keeps each step's carry: N copies of the buffer, N J D values per
token. Here the backward keeps the final buffer once and rebuilds step i's from it: the same buffer
with the entries from step i's first write on set to zero, which is what step i saw. Each step's
other carry (the hidden state, MUDD's mixed inputs) is kept as a plain scan keeps it, and each step's
forward is recomputed inside the backward pass, as `model.remat='full'` does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class History(NamedTuple):
    """Where the steps write: step i writes entries written[i] and on only (what it starts with is written[i])."""

    written: tuple[int, ...]


def scan(step: Callable[[Any, Any], Any], carry: Any, xs: Any, history: History) -> Any:
    """The final carry of `jax.lax.scan(lambda c, x: (step(c, x), None), carry, xs)`; carry.history is the
    history (an array, or a tree of arrays with the same leading J axis), written by step i at
    `history`'s indices only. Gradients flow to carry, xs and whatever
    `step` closes over."""
    converted, consts = jax.closure_convert(step, carry, jax.tree.map(lambda x: x[0], xs))
    return _scan(converted, history, carry, xs, *consts)


def _seen(blocks: Any, step_index: jax.Array, history: History) -> Any:
    """The history as step `step_index` received it: entries it and later steps write are zero."""
    kept_J = jnp.arange(jax.tree.leaves(blocks)[0].shape[0]) < jnp.asarray(history.written)[step_index]
    return jax.tree.map(
        lambda b_J: jnp.where(kept_J.reshape(-1, *[1] * (b_J.ndim - 1)), b_J, jnp.zeros((), b_J.dtype)), blocks
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan(step, history: History, carry, xs, *consts):
    return jax.lax.scan(lambda c, x: (step(c, x, *consts), None), carry, xs)[0]


def _forward(step, history, carry, xs, *consts):
    def one(c, x):
        return step(c, x, *consts), c._replace(history=None)  # each step's carry but its history

    final, carries = jax.lax.scan(one, carry, xs)
    return final, (final.history, carries, xs, consts)


def _backward(step, history, residuals, d_final):
    final_blocks, carries, xs, consts = residuals
    n = jax.tree.leaves(xs)[0].shape[0]
    zero_consts = jax.tree.map(jnp.zeros_like, consts)

    def one(acc, i_carry_x):
        d_carry, d_consts = acc
        i, c, x = i_carry_x
        c = c._replace(history=_seen(final_blocks, i, history))
        _, vjp = jax.vjp(lambda c, x, consts: step(c, x, *consts), c, x, consts)
        d_c, d_x, d_k = vjp(d_carry)
        return (d_c, jax.tree.map(jnp.add, d_consts, d_k)), d_x

    (d_carry, d_consts), d_xs = jax.lax.scan(one, (d_final, zero_consts), (jnp.arange(n), carries, xs), reverse=True)
    return (d_carry, d_xs, *d_consts)


_scan.defvjp(_forward, _backward)
