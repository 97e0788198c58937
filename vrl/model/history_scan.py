"""A layer scan whose carry holds a depth history, with a backward pass that keeps the history once.

DenseFormer's and MUDD's layers read every earlier block output (attention residuals' sublayers every
completed source), so the layer scan carries them as a buffer (J, B, L, D) that step i only appends to.
`jax.lax.scan`'s backward pass keeps what each step's backward needs, the history it read included: N
copies of the buffer, N J D values per token. Here the forward pass keeps each step's pullback (the
residuals `jax.vjp` saves, whatever `model.remat` lets it save) except the history, which the backward
pass rebuilds from the final one: the same buffer with the entries from step i's first write on set to
zero, which is what step i saw (and from step i + 1's first write on, which is what step i handed on,
where its backward reads the history it wrote). Residuals that are the step's own per-layer inputs or
the scan's constants are not copied per step either (as jax.lax.scan does not copy them). A residual
is recognised as one of these by identity: a method's mix must keep the history array it was handed
(tests/test_history_scan.py checks that the history is kept once for each method that has one).
"""

from __future__ import annotations

import dataclasses
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
    `history`'s indices only. Gradients flow to carry, xs and whatever `step` closes over."""
    converted, consts = jax.closure_convert(step, carry, jax.tree.map(lambda x: x[0], xs))
    return _scan(converted, history, carry, xs, *consts)


def _seen(blocks: Any, step_index: jax.Array, history: History) -> Any:
    """The history as step `step_index` received it (step n: the final one): entries it and later steps
    write are zero."""
    J = jax.tree.leaves(blocks)[0].shape[0]
    kept_J = jnp.arange(J) < jnp.asarray((*history.written, J))[step_index]
    return jax.tree.map(
        lambda b_J: jnp.where(kept_J.reshape(-1, *[1] * (b_J.ndim - 1)), b_J, jnp.zeros((), b_J.dtype)), blocks
    )


# where a pullback's leaf that is one of the step's inputs or its history output comes from
HISTORY, HISTORY_OUT, X, CONSTS = range(4)


@functools.partial(jax.tree_util.register_dataclass, data_fields=['saved'], meta_fields=['tree', 'sources'])
@dataclasses.dataclass(frozen=True)
class Pullbacks:
    """Every step's pullback: `saved` the leaves kept per step (stacked over steps), `tree` the pullback's
    structure, and per leaf its source: None (saved) or (HISTORY | HISTORY_OUT | X | CONSTS, index among
    their leaves)."""

    saved: list[jax.Array]
    tree: Any
    sources: tuple[tuple[int, int] | None, ...]

    def of_step(self, saved: list[jax.Array], inputs: tuple[list, ...]) -> Callable:
        """One step's pullback from its saved leaves and the leaves of `inputs` (by HISTORY, HISTORY_OUT, X,
        CONSTS)."""
        saved = iter(saved)
        leaves = [next(saved) if source is None else inputs[source[0]][source[1]] for source in self.sources]
        return jax.tree.unflatten(self.tree, leaves)


def _source_of(leaf: Any, inputs: tuple[list, ...]) -> tuple[int, int] | None:
    """(which of `inputs`, index) of the input that `leaf` is, or None."""
    for kind, leaves in enumerate(inputs):
        for index, input_leaf in enumerate(leaves):
            if leaf is input_leaf:
                return kind, index
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan(step, history: History, carry, xs, *consts):
    return jax.lax.scan(lambda c, x: (step(c, x, *consts), None), carry, xs)[0]


def _forward(step, history, carry, xs, *consts):
    layout = {}  # the pullback's tree and each leaf's source, known once the step is traced

    def one(c, x):
        out, pullback = jax.vjp(lambda c, x, consts: step(c, x, *consts), c, x, consts)
        leaves, layout['tree'] = jax.tree.flatten(pullback)
        inputs = (*(jax.tree.leaves(h) for h in (c.history, out.history)), jax.tree.leaves(x), jax.tree.leaves(consts))
        layout['sources'] = tuple(_source_of(leaf, inputs) for leaf in leaves)
        return out, [leaf for leaf, source in zip(leaves, layout['sources']) if source is None]

    final, saved = jax.lax.scan(one, carry, xs)
    return final, (final.history, Pullbacks(saved, **layout), xs, consts)


def _backward(step, history, residuals, d_final):
    final_history, pullbacks, xs, consts = residuals
    reads = {source[0] for source in pullbacks.sources if source is not None}
    zero_consts = jax.tree.map(jnp.zeros_like, consts)

    def one(acc, i_saved_x):
        d_carry, d_consts = acc
        i, saved, x = i_saved_x
        seen = [
            jax.tree.leaves(_seen(final_history, i + after, history)) if kind in reads else []
            for after, kind in enumerate((HISTORY, HISTORY_OUT))
        ]
        d_c, d_x, d_k = pullbacks.of_step(saved, (*seen, jax.tree.leaves(x), jax.tree.leaves(consts)))(d_carry)
        return (d_c, jax.tree.map(jnp.add, d_consts, d_k)), d_x

    n = jax.tree.leaves(xs)[0].shape[0]
    (d_carry, d_consts), d_xs = jax.lax.scan(
        one, (d_final, zero_consts), (jnp.arange(n), pullbacks.saved, xs), reverse=True
    )
    return (d_carry, d_xs, *d_consts)


_scan.defvjp(_forward, _backward)
