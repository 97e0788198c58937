"""vrl/model/history_scan.py: a layer scan whose backward pass rebuilds each step's depth history from
the final one gives jax.lax.scan's gradients, and keeps the history once, not once per step."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import random_tokens, randomize, rel_err, small_model_config
from vrl.model import history_scan
from vrl.model.decoder import Decoder


class Carry(NamedTuple):
    h: jax.Array  # (D,)
    history: jax.Array  # (J, D): step i writes row i + 1


def _toy(scan, w_NxDxD, scale, h0):
    """A scan of tanh layers whose input mixes every earlier output by weights from a closed-over scale
    (so that each step's backward reads the history it saw)."""
    J = w_NxDxD.shape[0] + 1

    def step(c: Carry, x):
        i, w = x
        mixed = jnp.tanh(jnp.einsum('j,jd->d', scale * jnp.linspace(0.5, 1.5, J), c.history) + c.h) @ w
        return Carry(mixed, jax.lax.dynamic_update_index_in_dim(c.history, mixed, i + 1, 0))

    xs = (jnp.arange(w_NxDxD.shape[0]), w_NxDxD)
    final = scan(step, Carry(h0, jnp.zeros((J, h0.shape[0])).at[0].set(h0)), xs)
    return jnp.sum(jnp.sin(final.h)) + jnp.sum(final.history**2)


def test_gradients_are_jax_scans_for_carry_xs_and_what_the_step_closes_over():
    rng = np.random.default_rng(0)
    w, h0 = jnp.asarray(rng.standard_normal((5, 6, 6)) / 3), jnp.asarray(rng.standard_normal(6))
    scale = jnp.asarray(0.7)
    plain = lambda step, c, xs: jax.lax.scan(lambda c, x: (step(c, x), None), c, xs)[0]  # noqa: E731
    rebuilt = lambda step, c, xs: history_scan.scan(step, c, xs, history_scan.History(tuple(range(1, 6))))  # noqa: E731
    want = jax.grad(lambda *a: _toy(plain, *a), argnums=(0, 1, 2))(w, scale, h0)
    got = jax.grad(lambda *a: _toy(rebuilt, *a), argnums=(0, 1, 2))(w, scale, h0)
    for g, wanted in zip(got, want):
        assert rel_err(g, wanted) < 1e-6
    wrong = lambda step, c, xs: history_scan.scan(step, c, xs, history_scan.History(tuple(range(2, 7))))  # noqa: E731
    off = jax.grad(lambda *a: _toy(wrong, *a), argnums=1)(w, scale, h0)  # a history rebuilt one row too long
    assert rel_err(off, want[1]) > 1e-3


def _equations(jaxpr, primitive: str) -> int:
    """How many equations of `primitive` a jaxpr holds, inside scans and calls too."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == primitive
        for value in eqn.params.values():
            inner = getattr(value, 'jaxpr', value)
            count += _equations(inner, primitive) if hasattr(inner, 'eqns') else 0
    return count


def test_the_backward_pass_recomputes_no_step():
    """Each step's pullback is kept from the forward pass, as jax.lax.scan keeps it: the toy's tanh is
    traced once (the forward's), not again in the backward pass (what remat would recompute, here none)."""
    rng = np.random.default_rng(1)
    w, h0, scale = jnp.asarray(rng.standard_normal((5, 6, 6)) / 3), jnp.asarray(rng.standard_normal(6)), 0.7
    rebuilt = lambda step, c, xs: history_scan.scan(step, c, xs, history_scan.History(tuple(range(1, 6))))  # noqa: E731
    gradient = jax.make_jaxpr(jax.grad(lambda w: _toy(rebuilt, w, scale, h0)))(w)
    assert _equations(gradient.jaxpr, 'tanh') == 1


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    """The shapes of every value a jaxpr makes, inside scans and calls too."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, 'shape')}
        for value in eqn.params.values():
            inner = getattr(value, 'jaxpr', value)
            shapes |= _shapes(inner) if hasattr(inner, 'eqns') else set()
    return shapes


@pytest.mark.parametrize('remat', ['full', 'none'])
@pytest.mark.parametrize(
    'method, entries',
    [
        (dict(residual='dense'), 13),
        (dict(residual='mudd', mudd_ways='qkvr'), 13),
        (dict(residual='attnres', attn_residual_blocks=0), 25),
        (dict(residual='attnres', attn_residual_blocks=12), 13),  # a block a layer: every MLP completes one
        (dict(residual='attnres', attn_residual_blocks=4), 5),  # blocks of 3 layers
    ],
    ids=['dense', 'mudd', 'attnres-full', 'attnres-block12', 'attnres-block4'],
)
def test_no_scanned_layer_keeps_a_copy_of_the_history(method, entries, remat):
    """12 layers (11 scanned): the gradient makes no (11, J, B, L, D) value, a history kept per layer,
    whichever sublayer reads it (a rewritten buffer is not the one the backward rebuilds)."""
    cfg = small_model_config(n_layers=12, remat=remat, compute_dtype='float32', **method)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = random_tokens(2, B=8, L=64)
    gradient = jax.make_jaxpr(jax.grad(lambda state: jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)))(state)
    assert (11, entries, 8, 64, cfg.d_model) not in _shapes(gradient.jaxpr)
    assert (entries, 8, 64, cfg.d_model) in _shapes(gradient.jaxpr)  # the history itself, once


def _temporaries(cfg) -> int:
    """The compiled gradient's temporary bytes for `cfg` on 8 x 64 tokens."""
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, 1)
    graphdef, state = nnx.split(model)
    tokens = random_tokens(2, B=8, L=64)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(tokens)[..., :97] ** 2)

    return jax.jit(jax.grad(loss)).lower(state).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize('remat', ['full', 'none'])
def test_the_history_is_kept_once_not_once_per_layer(monkeypatch, remat):
    """12 layers of MUDD (qkvr): jax.lax.scan keeps 11 copies of the 13-output history (and of the mixed
    q, k, v inputs); history_scan's compiled gradient saves at least 80% of the history's 11 copies."""
    cfg = small_model_config(n_layers=12, residual='mudd', mudd_ways='qkvr', remat=remat, compute_dtype='float32')
    once = _temporaries(cfg)
    monkeypatch.setattr(  # what jax.lax.scan keeps: the carry, history included, once per step
        history_scan, 'scan', lambda step, c, xs, h: jax.lax.scan(lambda c, x: (step(c, x), None), c, xs)[0]
    )
    per_layer = _temporaries(cfg)
    B, L, D = 8, 64, cfg.d_model
    history = 11 * 13 * B * L * D * 4
    assert per_layer - once > 0.8 * history, (once, per_layer, history)


@pytest.mark.parametrize('remat', ['full', 'none'])
def test_attention_residuals_keep_their_sources_once(monkeypatch, remat):
    """Full AttnRes over 12 layers: 25 sources, which jax.lax.scan would keep once per stacked layer."""
    cfg = small_model_config(
        n_layers=12, residual='attnres', attn_residual_blocks=0, remat=remat, compute_dtype='float32'
    )
    once = _temporaries(cfg)
    monkeypatch.setattr(
        history_scan, 'scan', lambda step, c, xs, h: jax.lax.scan(lambda c, x: (step(c, x), None), c, xs)[0]
    )
    per_layer = _temporaries(cfg)
    B, L, D = 8, 64, cfg.d_model
    assert per_layer - once > 0.8 * 11 * 25 * B * L * D * 4, (once, per_layer)
