"""vrl/model/ops.py: values and gradients of the hand-written backward passes, against float64
autodiff of the plain formulations, on random inputs and cotangents."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import cases, rel_err
from vrl.model import ops


def _value_and_vjp(fn, args, cotangent):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(cotangent)


def _check_against_float64(op, reference, args, n_grads: int, tol: float = 2e-6):
    """op in float32 vs reference in float64: output and the first n_grads input gradients."""
    out = op(*args)
    cotangent = jax.random.normal(jax.random.key(99), out.shape, out.dtype)
    out, grads = _value_and_vjp(op, args, cotangent)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(a), jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
        ref_out, ref_grads = _value_and_vjp(reference, args64, jnp.asarray(np.asarray(cotangent), jnp.float64))
    assert out.dtype == jnp.float32
    assert rel_err(out, ref_out) < tol
    for grad, ref_grad in zip(grads[:n_grads], ref_grads[:n_grads]):
        assert grad.dtype == jnp.float32
        assert rel_err(grad, ref_grad) < tol


def _normal(seed: int, *shape: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize(
    'x_shape,w_shape,n_contract',
    [
        ((3, 5, 16), (16, 24), 1),  # x (B, L, D) @ (D, F): the MLP, where d_ff > d_model
        ((3, 5, 24), (24, 16), 1),  # (B, L, F) @ (F, D): the other orientation
        ((3, 5, 16), (16, 4, 6), 1),  # (B, L, D) @ (D, H, Dh): q, k, v
        ((3, 5, 4, 6), (4, 6, 16), 2),  # (B, L, H, Dh) @ (H, Dh, D): the output projection
    ],
)
def test_project_matches_autodiff(x_shape, w_shape, n_contract):
    x, w = _normal(0, *x_shape), _normal(1, *w_shape)
    _check_against_float64(
        lambda x, w: ops.project(x, w, n_contract), lambda x, w: jnp.tensordot(x, w, axes=n_contract), [x, w], n_grads=2
    )


def _capped(logits, cap: float):
    return cap * jnp.tanh(logits / cap) if cap else logits


def _plain_attention(q_BxLxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxLxS, cap: float = 0.0):
    logits = jnp.einsum('blkgd,bskd->bkgls', q_BxLxKxGxDh, k_BxSxKxDh) / math.sqrt(q_BxLxKxGxDh.shape[-1])
    logits = _capped(logits, cap)
    probs = jax.nn.softmax(jnp.where(mask_BxLxS[:, None, None], logits, -1e30), axis=-1)
    return jnp.einsum('bkgls,bskd->blkgd', probs, v_BxSxKxDh)


def _masks(B: int, L: int, S: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    causal = np.broadcast_to(np.tril(np.ones((L, S), bool), S - L), (B, L, S))
    documents = np.sort(rng.integers(0, 3, (B, S)), axis=1)  # packed, as with segment ids
    left_padded = causal & (np.arange(S)[None, None, :] >= np.array([0, 2])[:B, None, None])
    return {
        'causal': causal,
        'documents': causal & (documents[:, S - L :, None] == documents[:, None, :]),
        'left padded, rows 0-1 of sequence 1 see nothing': left_padded,
    }


@pytest.mark.parametrize(
    'kv_heads,groups,mask_name',
    cases(
        {
            f'{heads}-{mask}': (k, g, mask)
            for heads, k, g in (('gqa', 2, 3), ('mha', 4, 1), ('mqa', 1, 4))
            for mask in _masks(2, 7, 7)
        },
        [f'gqa-{mask}' for mask in _masks(2, 7, 7)],
    ),
)
def test_attention_matches_autodiff(kv_heads, groups, mask_name):
    B, L, Dh = 2, 7, 8
    mask = jnp.asarray(_masks(B, L, L)[mask_name])
    q, k, v = _normal(2, B, L, kv_heads, groups, Dh), _normal(3, B, L, kv_heads, Dh), _normal(4, B, L, kv_heads, Dh)
    _check_against_float64(ops.attention, _plain_attention, [q, k, v, mask], n_grads=3)


@pytest.mark.parametrize('cap', [0.5, 3.0], ids=['most logits at the cap', 'some logits at the cap'])
def test_soft_capped_attention_matches_autodiff(cap):
    """Logits of about +-10 (inputs scaled up) capped at `cap`: the hand-written backward's slope
    1 - (capped / cap)^2 against float64 autodiff through tanh, with document masking."""
    B, L, Dh = 2, 7, 8
    mask = jnp.asarray(_masks(B, L, L)['documents'])
    q, k, v = 3 * _normal(30, B, L, 2, 3, Dh), 3 * _normal(31, B, L, 2, Dh), _normal(32, B, L, 2, Dh)
    for op in (ops.attention, ops.plain_attention):
        _check_against_float64(
            lambda q, k, v: op(q, k, v, mask, cap), lambda q, k, v: _plain_attention(q, k, v, mask, cap), [q, k, v], 3
        )


def test_attention_over_a_longer_cache():
    """Decoding: T new queries over S >= T cached keys."""
    B, T, S, K, G, Dh = 2, 3, 9, 2, 2, 8
    mask = jnp.asarray(_masks(B, T, S)['causal'])
    q, k, v = _normal(5, B, T, K, G, Dh), _normal(6, B, S, K, Dh), _normal(7, B, S, K, Dh)
    _check_against_float64(ops.attention, _plain_attention, [q, k, v, mask], n_grads=3)


@pytest.mark.parametrize(
    'B,K,G,T',
    cases(
        {
            f'{T}-{name}': (B, K, G, T)
            for name, B, K, G in (('mha-batch-1', 1, 4, 1), ('gqa', 2, 2, 3), ('mqa', 2, 1, 4))
            for T in (1, 3)
        },
        ['1-mha-batch-1', '3-gqa'],
    ),
)
def test_attention_over_cache_slots(B, K, G, T):
    """ops.attend_cache, the decoder's attention over (B * K, S, Dh) slots, against the float64
    reference on the same keys and values laid out (B, S, K, Dh)."""
    S, Dh = 9, 8
    mask = jnp.asarray(_masks(B, T, S)['left padded, rows 0-1 of sequence 1 see nothing'])
    q, k, v = _normal(17, B, T, K, G, Dh), _normal(18, B, S, K, Dh), _normal(19, B, S, K, Dh)
    slots = [x.transpose(0, 2, 1, 3).reshape(B * K, S, Dh) for x in (k, v)]
    out = ops.attend_cache(q.reshape(B, T, K * G, Dh), *slots, mask)
    with jax.enable_x64(True):
        want = _plain_attention(*(jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v)), mask)
    assert out.shape == (B, T, K * G, Dh)
    assert rel_err(out, want.reshape(B, T, K * G, Dh)) < 2e-6


def test_fully_masked_query_attends_uniformly():
    B, L, K, G, Dh = 1, 4, 1, 1, 8
    mask = jnp.zeros((B, L, L), bool).at[:, 1:].set(jnp.tril(jnp.ones((L - 1, L), bool), 1))
    v = _normal(8, B, L, K, Dh)
    out = ops.attention(_normal(9, B, L, K, G, Dh), _normal(10, B, L, K, Dh), v, mask)
    assert rel_err(out[0, 0, 0, 0], jnp.mean(v[0, :, 0], axis=0)) < 1e-6


def test_swiglu_matches_autodiff():
    gate, up = _normal(11, 3, 5, 24), _normal(12, 3, 5, 24)
    _check_against_float64(ops.swiglu, lambda gate, up: jax.nn.silu(gate) * up, [gate, up], n_grads=2)


def test_bfloat16_keeps_dtypes_and_follows_float32():
    B, L, K, G, Dh = 2, 16, 2, 2, 16
    mask = jnp.asarray(_masks(B, L, L)['causal'])
    args = [_normal(13, B, L, K, G, Dh), _normal(14, B, L, K, Dh), _normal(15, B, L, K, Dh)]
    cotangent = _normal(16, B, L, K, G, Dh)
    out32, grads32 = _value_and_vjp(lambda q, k, v: ops.attention(q, k, v, mask), args, cotangent)
    out16, grads16 = _value_and_vjp(
        lambda q, k, v: ops.attention(q, k, v, mask),
        [a.astype(jnp.bfloat16) for a in args],
        cotangent.astype(jnp.bfloat16),
    )
    assert out16.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads16)
    assert rel_err(out16, out32) < 2e-2
    for g16, g32 in zip(grads16, grads32):
        assert rel_err(g16, g32) < 5e-2

    x, w = _normal(17, 4, 32), _normal(18, 32, 48)
    logits = ops.project(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), 1, jnp.float32)
    assert logits.dtype == jnp.float32 and rel_err(logits, x @ w) < 2e-2
    dx, dw = jax.grad(lambda x, w: jnp.sum(ops.project(x, w, 1, jnp.float32) ** 2), argnums=(0, 1))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    )
    assert dx.dtype == dw.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(dx, np.float32)))


def _dot_operand_dtypes(fn, *args) -> list[tuple[str, str]]:
    """The operand dtypes of every dot in fn's program as compiled for this backend."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    dtype_of = dict(re.findall(r'%(\S+) = (\w+)\[', hlo))
    return [
        tuple(dtype_of[name] for name in re.findall(r'%([^,\s)]+)', operands))
        for operands in re.findall(r' dot\(([^)]*)\)', hlo)
    ]


@pytest.mark.skipif(jax.default_backend() != 'cpu', reason="XLA:CPU's bfloat16 dot rules")
def test_bfloat16_matmuls_run_in_bfloat16_on_cpu():
    """XLA:CPU runs a bf16 x bf16 -> f32 dot natively only in one operand form and converts both
    operands of any other to float32 first, which left the bf16 train step no faster than float32:
    every dot of the ops' forward and backward passes keeps bfloat16 operands."""
    bf16 = jnp.bfloat16
    cases = [
        ((2, 32, 48), (48, 80), 1),
        ((2, 32, 80), (80, 48), 1),
        ((2, 32, 48), (48, 4, 16), 1),
        ((2, 32, 4, 16), (4, 16, 48), 2),
    ]
    for x_shape, w_shape, n_contract in cases:
        x, w = _normal(40, *x_shape).astype(bf16), _normal(41, *w_shape).astype(bf16)
        grads = jax.grad(lambda x, w: jnp.sum(ops.project(x, w, n_contract, jnp.float32) ** 2), argnums=(0, 1))
        assert set(_dot_operand_dtypes(grads, x, w)) == {('bf16', 'bf16')}, (x_shape, w_shape)
    B, L, K, G, Dh = 2, 32, 2, 2, 16
    mask = jnp.asarray(_masks(B, L, L)['causal'])
    q, k, v = (_normal(42, B, L, K, G, Dh), _normal(43, B, L, K, Dh), _normal(44, B, L, K, Dh))
    attention = jax.grad(
        lambda q, k, v: jnp.sum(ops.attention(q, k, v, mask).astype(jnp.float32) ** 2), argnums=(0, 1, 2)
    )
    assert set(_dot_operand_dtypes(attention, *(a.astype(bf16) for a in (q, k, v)))) == {('bf16', 'bf16')}
    x, w = _normal(45, B, L, 48).astype(bf16), _normal(46, 48, 96).astype(bf16)
    targets, weights = jax.random.randint(jax.random.key(47), (B, L), 0, 90), jnp.ones((B, L))
    loss = jax.grad(lambda x, w: ops.cross_entropy_sums(x, w, targets, weights, 90, 1e-4, 2)[0], argnums=(0, 1))
    assert set(_dot_operand_dtypes(loss, x, w)) == {('bf16', 'bf16')}


@pytest.mark.skipif(jax.default_backend() != 'cpu', reason="XLA:CPU's handling of stacked bfloat16 arrays")
def test_bfloat16_residuals_are_stacked_as_they_are_on_cpu():
    """Under a layer scan the backward pass's residuals are stacked over layers. XLA:CPU converts a
    stacked bfloat16 array to float32 whole to write or read a layer of it; the hand-written ops
    keep theirs as bits, so no float32 stack of a residual exists. Autodiff's plain ops show the
    check can fail."""
    n_layers, B, L, K, G, Dh, F = 3, 2, 32, 2, 2, 16, 96
    D = K * G * Dh
    bf16 = jnp.bfloat16
    mask = jnp.asarray(_masks(B, L, L)['causal'])
    weights = tuple(
        _normal(50 + i, n_layers, *shape).astype(bf16)
        for i, shape in enumerate([(D, K, G, Dh), (D, K, Dh), (D, K, Dh), (D, F), (D, F), (F, D)])
    )

    def loss(chosen: ops.HandVjpOps, x, weights):
        def layer(x, w):
            wq, wk, wv, w_gate, w_up, w_down = w
            o = chosen.attention(chosen.project(x, wq, 1), chosen.project(x, wk, 1), chosen.project(x, wv, 1), mask)
            x = x + o.reshape(x.shape)
            hidden = chosen.swiglu(chosen.project(x, w_gate, 1), chosen.project(x, w_up, 1))
            return x + chosen.project(hidden, w_down, 1), None

        return jnp.sum(jax.lax.scan(layer, x, weights)[0].astype(jnp.float32) ** 2)

    def float32_stacks(hand_vjp: str) -> set[str]:
        grad = jax.jit(jax.grad(functools.partial(loss, ops.hand_vjp_ops(hand_vjp)), argnums=(0, 1)))
        text = grad.lower(_normal(49, B, L, D).astype(bf16), weights).compile().as_text()
        residuals = {(B, L, F), (B, K, G, L, Dh), (B, K, L, Dh)}
        return {
            shape
            for shape in re.findall(rf'f32\[{n_layers},([\d,]+)\]', text)
            if tuple(map(int, shape.split(','))) in residuals
        }

    assert float32_stacks('all') == set()
    assert float32_stacks('none')


def _plain_cross_entropy_sums(x_BxLxD, w_DxV, targets_BxL, weights_BxL, vocab_size, z_loss, cap: float = 0.0):
    logits = _capped(jnp.einsum('bld,dv->blv', x_BxLxD, w_DxV)[..., :vocab_size], cap)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    cross_entropy = (log_z - jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]) * weights_BxL
    return jnp.sum(cross_entropy + z_loss * weights_BxL * log_z**2), jnp.sum(cross_entropy)


@pytest.mark.parametrize(
    'z_loss,chunks,cap',
    [(0.0, 1, 0.0), (0.3, 1, 0.0), (0.3, 3, 0.0), (0.0, 4, 0.0), (0.3, 3, 2.0)],
    ids=['no z-loss', 'z-loss', '3 slices', '4 slices (3: 4 does not divide 6)', 'soft cap 2, z-loss, 3 slices'],
)
@pytest.mark.parametrize('logit_scale', [1.0, 40.0], ids=['unit', 'large logits'])
def test_cross_entropy_sums_match_autodiff(z_loss, chunks, cap, logit_scale):
    """Head + loss: both sums and the gradients of the first against float64 autodiff, with padded
    vocab columns (never part of the softmax, zero gradient), a random weight per token, the
    tokens in slices of the sequence, and the logits soft-capped (the slope in the backward)."""
    B, L, D, V, vocab_size = 2, 6, 16, 24, 21
    x, w = _normal(19, B, L, D), _normal(20, D, V) * (logit_scale / math.sqrt(D))
    targets = jax.random.randint(jax.random.key(21), (B, L), 0, vocab_size)
    weights = jax.random.uniform(jax.random.key(22), (B, L)) * (jnp.arange(L) != 2)[None, :]  # one token masked out
    d_loss = 1.7  # the cotangent of the loss, as a loss scale would be
    sums, vjp = jax.vjp(
        lambda x, w: ops.cross_entropy_sums(x, w, targets, weights, vocab_size, z_loss, chunks, cap), x, w
    )
    dx, dw = vjp((jnp.float32(d_loss), jnp.float32(0.0)))
    with jax.enable_x64(True):
        x64, w64, weights64 = (jnp.asarray(np.asarray(a), jnp.float64) for a in (x, w, weights))
        ref_sums, ref_vjp = jax.vjp(
            lambda x, w: _plain_cross_entropy_sums(x, w, targets, weights64, vocab_size, z_loss, cap), x64, w64
        )
        ref_dx, ref_dw = ref_vjp((jnp.float64(d_loss), jnp.float64(0.0)))
    # capped logits near +-cap: the slope 1 - tanh^2 loses float32 digits to cancellation (jax's own
    # tanh derivative is the same formula)
    tol = 1e-5 if cap else 2e-6
    for value, ref in zip(sums, ref_sums):
        assert abs(float(value) - float(ref)) / abs(float(ref)) < 2e-6
    assert rel_err(dx, ref_dx) < tol and rel_err(dw, ref_dw) < tol
    assert np.all(np.asarray(dw)[:, vocab_size:] == 0)


def test_cross_entropy_statistic_carries_no_gradient_and_eval_path_agrees():
    B, L, D, V = 2, 3, 8, 16
    x, w = _normal(23, B, L, D), _normal(24, D, V)
    targets, weights = jax.random.randint(jax.random.key(25), (B, L), 0, 15), jnp.ones((B, L))
    dx = jax.grad(lambda x: ops.cross_entropy_sums(x, w, targets, weights, 15, 0.0, 3)[1])(x)
    assert np.all(np.asarray(dx) == 0)
    (loss, statistic), _ = jax.value_and_grad(
        lambda x: ops.cross_entropy_sums(x, w, targets, weights, 15, 0.0, 3), has_aux=True
    )(x)
    plain = jax.jit(lambda x: ops.cross_entropy_sums(x, w, targets, weights, 15, 0.0, 3))(x)  # not differentiated
    assert float(loss) == float(statistic) and abs(float(plain[0]) - float(loss)) / float(loss) < 1e-6


def test_cross_entropy_slices_bound_the_logits_memory():
    """The compiled gradient of the fused head and loss holds one slice's (B, L / chunks, V) float32
    logits at a time: its temporaries shrink with the slices."""
    B, L, D, V = 2, 512, 32, 8192
    x, w = _normal(26, B, L, D), _normal(27, D, V)
    targets, weights = jax.random.randint(jax.random.key(28), (B, L), 0, V), jnp.ones((B, L))

    def temporaries(chunks: int) -> int:
        grad = jax.grad(lambda x, w: ops.cross_entropy_sums(x, w, targets, weights, V, 1e-4, chunks)[0], argnums=(0, 1))
        return jax.jit(grad).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = B * L * V * 4
    whole, sliced = temporaries(1), temporaries(4)
    assert whole >= logits_bytes
    assert sliced <= whole / 2, (whole, sliced)
