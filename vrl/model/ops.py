"""The model's hot operations with hand-written backward passes: projection, attention, SwiGLU,
and the output head fused with the cross-entropy loss.

Each is a plain function (`plain_*`, differentiated by autodiff) made a `jax.custom_vjp` with a
hand-written backward that computes what autodiff would (tests/test_ops.py checks them against
float64 autodiff); they exist because of how XLA lays the autodiff graphs out (what each saves:
docs/performance.md, from `python bench/train_throughput.py` and `python bench/hand_vjp.py`).
`model.hand_vjp` picks, per op, which one a model uses (`hand_vjp_ops`); under `auto`,
HAND_VJP_BY_PLATFORM says what each backend runs.

- `project` (x @ W over the trailing dims of x): autodiff's weight gradient contracts over the
  token axis, and XLA transposes the larger operand (the (tokens, d_ff) gradient) inside a slow
  fused loop. Here the backward transposes whichever operand is smaller, on its own. Every
  matmul is also written in the one form XLA:CPU runs in bfloat16 (row-major operands, the left
  one contracted on its last axis, a float32 result): it converts both operands of any other
  bf16 dot to float32 first, which made the bf16 step no faster than the float32 one.
- `attention`: autodiff keeps the (B, K, G, L, S) probabilities for the backward pass (stacked
  over all layers under the scan) and differentiates the softmax through its normalisation.
  Here only the output and the per-row softmax max and sum are kept; the backward recomputes the
  probabilities from them, the memory-efficient ("flash") formulation. Its matmuls run with
  batch and heads leading, and the products that contract over queries transpose the small
  (L, Dh) operand rather than the (L, S) matrix.
- `swiglu`: keeps gate and up for the backward instead of four (L, d_ff) intermediates.
- Soft-capping (`soft_cap`: cap * tanh(x / cap), Gemma 2's, off at cap 0) of the attention logits
  and of the final logits enters each backward as its slope 1 - (capped / cap)^2, from the
  capped logits that backward has at hand.
- `cross_entropy_sums` (head + loss): the loss is a scalar, so when it is differentiated its
  forward pass computes d loss / d logits while the (B, L, V) logits are at hand and runs both
  head matmuls of the backward right there; the backward only scales the two gradients by the
  incoming scalar. The logits are never kept, and each pass over them is made once. The tokens
  go through in `model.head_chunks` slices of the sequence, so only a slice's logits exist at a
  time: the weight gradient is summed over the slices in float32.

Every bfloat16 residual the hand-written backwards keep is kept as its uint16 bits (`_as_bits`):
XLA:CPU writes and reads a layer of a scan-stacked bfloat16 array by converting the whole stack
to float32 and back (a large share of the bf16 step's op time; docs/performance.md).

Shape suffixes as in vrl/model/decoder.py; T = B * L tokens, I / O the flattened contracted / output dims.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vrl.core.sharding import Axis, constrain, context_parts
from vrl.model.config import HAND_VJP_OPS

Array = jax.Array

_MASKED = -1e30  # the logit of a key a query may not see


def rms_normalized(x: Array, eps: float, axes: tuple[int, ...] = (-1,)) -> Array:
    """x / sqrt(mean(x^2 over `axes`) + eps) in float32, unscaled: every RMSNorm of the model."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)


def dot_last(a: Array, b: Array) -> Array:
    """sum_d a * b over the last axis (broadcast), float32: one elementwise loop. The depth mixes'
    passes over a (J, B, L, D) buffer are written so: XLA:CPU runs a matrix-vector dot single-threaded,
    and a dot over the other axes transposes the buffer first (docs/performance.md)."""
    return jnp.sum(a.astype(jnp.float32) * b, axis=-1)


def mix_rows(weights_JxBxL: Array, rows_JxBxLxD: Array) -> Array:
    """sum_j weights[j] rows[j] (B, L, D), float32: one elementwise loop over the J rows (an einsum over J
    transposes the rows first, as `dot_last` says)."""
    return sum(w[..., None].astype(jnp.float32) * r.astype(jnp.float32) for w, r in zip(weights_JxBxL, rows_JxBxLxD))


def soft_cap(logits: Array, cap: float) -> Array:
    """cap * tanh(logits / cap), elementwise; the logits as they are for cap 0 (off)."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def _through_soft_cap(d_capped: Array, capped: Array, cap: float) -> Array:
    """The gradient d_capped of soft_cap's output taken back to its input: times the slope
    1 - (capped / cap)^2 (d_capped itself for cap 0)."""
    return d_capped * (1 - jnp.square(capped / cap)) if cap else d_capped


def _pinned(x: Array, pin: bool = True) -> Array:
    """x (a transpose), kept by a barrier from being folded into the dot that consumes it, where
    XLA:CPU would transpose the dot's other, larger operand in a slow fused loop instead."""
    return jax.lax.optimization_barrier(x) if pin else x


def _as_bits(residuals):
    """Residuals as the backward pass keeps them: bfloat16 arrays as their uint16 bits. Under the
    layer scan each is stacked over layers, and XLA:CPU writes and reads a stacked bfloat16 array
    by converting the whole stack to float32 and back at every layer; a bit cast costs nothing
    on any backend (468M on v5e:4x4: the same memory, `python bench/hand_vjp.py`)."""
    return _bitcast_leaves(residuals, jnp.bfloat16, jnp.uint16)


def _from_bits(residuals):
    """`_as_bits`'s inverse."""
    return _bitcast_leaves(residuals, jnp.uint16, jnp.bfloat16)


def _bitcast_leaves(tree, source: jnp.dtype, target: jnp.dtype):
    return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, target) if a.dtype == source else a, tree)


def plain_project(x: Array, w: Array, n_contract: int, out_dtype: jnp.dtype | None = None) -> Array:
    """Contracts the last `n_contract` dims of x (..., *C) with the first of w (*C, *O) -> (..., *O).

    The product accumulates in float32 and is returned in `out_dtype` (default: x's dtype).
    """
    return _project_fwd(x, w, n_contract, out_dtype)[0]


project = jax.custom_vjp(plain_project, nondiff_argnums=(2, 3))


def _token_axes(a: Array, n_trailing: int) -> tuple[int, ...]:
    """The sizes of a's token axes (all but the last n_trailing) as the matmuls hold them: merged into
    one, or kept apart where sequences are split over `context`. A merged axis cannot be split
    as the batch and length axes are (each device holds some rows' part of the sequence), so XLA's
    partitioner would move hidden states between devices around every matmul."""
    tokens = a.shape[: a.ndim - n_trailing]
    return tokens if context_parts() > 1 else (math.prod(tokens),)


def _as_matrices(x: Array, w: Array, n_contract: int) -> tuple[Array, Array]:
    """x as (*tokens, I) (`_token_axes`) and w as (I, O)."""
    contracted = math.prod(w.shape[:n_contract])
    return x.reshape(*_token_axes(x, n_contract), contracted), w.reshape(contracted, -1)


def _project_fwd(x: Array, w: Array, n_contract: int, out_dtype: jnp.dtype | None):
    x_TxI, w_IxO = _as_matrices(x, w, n_contract)
    y_TxO = jnp.dot(x_TxI, w_IxO, preferred_element_type=jnp.float32)
    y = y_TxO.astype(out_dtype or x.dtype).reshape(*x.shape[: x.ndim - n_contract], *w.shape[n_contract:])
    return y, _as_bits((x, w))


def _tokens_last(a: Array, n_trailing: int) -> Array:
    """a (*tokens, *trailing) as (prod trailing, *token axes) (`_token_axes`), transposed in memory
    (the reshape that merges the token axes keeps XLA from turning the transpose into a layout
    change)."""
    lead = a.ndim - n_trailing
    transposed = a.transpose(*range(lead, a.ndim), *range(lead))
    return _pinned(transposed.reshape(-1, *_token_axes(a, n_trailing)))


def _project_bwd(n_contract: int, out_dtype: jnp.dtype | None, residuals, dy: Array):
    del out_dtype
    x, w = _from_bits(residuals)
    dx, dw_f32 = _project_grads(x, w, n_contract, dy)
    return dx, dw_f32.astype(w.dtype)


def _project_grads(x: Array, w: Array, n_contract: int, dy: Array) -> tuple[Array, Array]:
    """dx (x's dtype) and dw (float32) of y = project(x, w) for the cotangent dy, each matmul in the
    one form XLA:CPU runs in bfloat16 (row-major operands contracting the left one's last axis; any
    other form it converts to float32 first): dx = dy W^T contracts both operands' last axes; the
    weight gradient contracts over tokens, so the smaller operand is transposed in memory first,
    on its own."""
    x_TxI, w_IxO = _as_matrices(x, w, n_contract)
    I, O = w_IxO.shape
    dy = dy.astype(x.dtype).reshape(*x.shape[: x.ndim - n_contract], O)
    dy_TxO = dy.reshape(*_token_axes(dy, 1), O)
    dx_TxI = jnp.einsum('...o,io->...i', dy_TxO, w_IxO, preferred_element_type=jnp.float32)
    if I <= O:
        dw_IxO = jnp.einsum('i...,...o->io', _tokens_last(x, n_contract), dy_TxO, preferred_element_type=jnp.float32)
    else:  # transposed back after a barrier: folded into the dot, the transpose sends it to a slow path
        dw_OxI = jnp.einsum('o...,...i->oi', _tokens_last(dy, 1), x_TxI, preferred_element_type=jnp.float32)
        dw_IxO = _pinned(dw_OxI).T
    return dx_TxI.astype(x.dtype).reshape(x.shape), dw_IxO.reshape(w.shape)


project.defvjp(_project_fwd, _project_bwd)


def plain_attention(
    q_BxLxKxGxDh: Array, k_BxSxKxDh: Array, v_BxSxKxDh: Array, mask_BxLxS: Array, logits_cap: float = 0.0
) -> Array:
    """Softmax attention of grouped query heads over their kv head -> (B, L, K, G, Dh), the logits
    q.k / sqrt(Dh) soft-capped at `logits_cap` (0: not capped).

    Logits and softmax are float32. A query whose keys are all masked attends uniformly.
    """
    q, k, v = _heads_major(q_BxLxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, pin=False)
    out_BxKxGxLxDh, _ = _attend(q, k, v, mask_BxLxS, logits_cap)
    return out_BxKxGxLxDh.transpose(0, 3, 1, 2, 4)


attention = jax.custom_vjp(plain_attention, nondiff_argnums=(4,))


def attend_cache(
    q_BxLxHxDh: Array, k_NxSxDh: Array, v_NxSxDh: Array, mask_BxLxS: Array, logits_cap: float = 0.0
) -> Array:
    """Attention over a KV cache's slots, rows N = B * K (sequence-major), forward only -> (B, L, H, Dh).

    Every matmul reads a slot as it lies, with no unit axis for XLA to drop: XLA:CPU transposed
    or copied a (B, K, S, Dh) slot whenever the batch was 1. The logits are soft-capped at
    `logits_cap` as `attention`'s are.
    """
    B, L, H, Dh = q_BxLxHxDh.shape
    N, S = k_NxSxDh.shape[:2]
    K = N // B
    q_BxKxGxLxDh = _queries_heads_major(q_BxLxHxDh.reshape(B, L, K, H // K, Dh), pin=False)
    logits_NxQxS = jnp.einsum(
        'nqd,nsd->nqs', q_BxKxGxLxDh.reshape(N, -1, Dh), k_NxSxDh, preferred_element_type=jnp.float32
    )
    capped_BxKxGxLxS = soft_cap(logits_NxQxS.reshape(B, K, -1, L, S), logits_cap)
    logits_BxKxGxLxS = jnp.where(mask_BxLxS[:, None, None], capped_BxKxGxLxS, _MASKED)
    probs_NxQxS = jax.nn.softmax(logits_BxKxGxLxS, axis=-1).astype(v_NxSxDh.dtype).reshape(N, -1, S)
    out_NxQxDh = jnp.einsum('nqs,nsd->nqd', probs_NxQxS, v_NxSxDh, preferred_element_type=jnp.float32)
    return out_NxQxDh.astype(v_NxSxDh.dtype).reshape(B, K, -1, L, Dh).transpose(0, 3, 1, 2, 4).reshape(B, L, H, Dh)


def _queries_heads_major(q_BxLxKxGxDh: Array, pin: bool) -> Array:
    """(B, K, G, L, Dh), scaled by 1/sqrt(Dh)."""
    q_BxLxKxGxDh = q_BxLxKxGxDh * (1 / math.sqrt(q_BxLxKxGxDh.shape[-1]))
    return _pinned(q_BxLxKxGxDh.transpose(0, 2, 3, 1, 4), pin)


def _heads_major(q_BxLxKxGxDh: Array, k_BxSxKxDh: Array, v_BxSxKxDh: Array, pin: bool) -> tuple[Array, Array, Array]:
    """Batch and heads leading, as the batched matmuls want them; q is scaled by 1/sqrt(Dh)."""
    return (
        _queries_heads_major(q_BxLxKxGxDh, pin),
        _pinned(k_BxSxKxDh.transpose(0, 2, 1, 3), pin),
        _pinned(v_BxSxKxDh.transpose(0, 2, 1, 3), pin),
    )


def _logits(q_BxKxGxLxDh: Array, k_BxKxSxDh: Array, mask_BxLxS: Array, cap: float) -> Array:
    """The float32 logits, soft-capped at `cap`, _MASKED where the mask hides a key."""
    logits_BxKxGxLxS = jnp.einsum('bkgld,bksd->bkgls', q_BxKxGxLxDh, k_BxKxSxDh, preferred_element_type=jnp.float32)
    return jnp.where(mask_BxLxS[:, None, None], soft_cap(logits_BxKxGxLxS, cap), _MASKED)


def _probs(logits_BxKxGxLxS: Array, max_BxKxGxLx1: Array, sum_BxKxGxLx1: Array) -> Array:
    return jnp.exp(logits_BxKxGxLxS - max_BxKxGxLx1) * (1 / sum_BxKxGxLx1)


def _attend(
    q_BxKxGxLxDh: Array, k_BxKxSxDh: Array, v_BxKxSxDh: Array, mask_BxLxS: Array, cap: float
) -> tuple[Array, tuple[Array, Array]]:
    """(output (B, K, G, L, Dh), the float32 max and sum (B, K, G, L, 1) of each query's softmax)."""
    logits_BxKxGxLxS = _logits(q_BxKxGxLxDh, k_BxKxSxDh, mask_BxLxS, cap)
    max_BxKxGxLx1 = jnp.max(logits_BxKxGxLxS, axis=-1, keepdims=True)
    sum_BxKxGxLx1 = jnp.sum(jnp.exp(logits_BxKxGxLxS - max_BxKxGxLx1), axis=-1, keepdims=True)
    probs = _probs(logits_BxKxGxLxS, max_BxKxGxLx1, sum_BxKxGxLx1).astype(v_BxKxSxDh.dtype)
    # a float32 product, cast after: XLA:CPU converts a dot with a bfloat16 output to float32 first
    out_BxKxGxLxDh = jnp.einsum('bkgls,bksd->bkgld', probs, v_BxKxSxDh, preferred_element_type=jnp.float32)
    return out_BxKxGxLxDh.astype(v_BxKxSxDh.dtype), (max_BxKxGxLx1, sum_BxKxGxLx1)


def _attention_fwd(
    q_BxLxKxGxDh: Array, k_BxSxKxDh: Array, v_BxSxKxDh: Array, mask_BxLxS: Array, logits_cap: float = 0.0
):
    q, k, v = _heads_major(q_BxLxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, pin=True)
    out_BxKxGxLxDh, softmax_stats = _attend(q, k, v, mask_BxLxS, logits_cap)
    return out_BxKxGxLxDh.transpose(0, 3, 1, 2, 4), _as_bits((q, k, v, mask_BxLxS, out_BxKxGxLxDh, softmax_stats))


def _attention_bwd(logits_cap: float, residuals, d_out_BxLxKxGxDh: Array):
    """Recomputes the probabilities P exactly as the forward did; dV = P^T dO, dP = dO V^T,
    dlogits = P * (dP - <dO, O>) * the soft cap's slope where unmasked (0 where masked),
    dQ = dlogits K and dK = dlogits^T Q. dV and dK transpose their small operand (dO, Q), not
    the (L, S) matrix."""
    q, k, v, mask_BxLxS, out_BxKxGxLxDh, (max_BxKxGxLx1, sum_BxKxGxLx1) = _from_bits(residuals)
    B, K, G, L, Dh = q.shape
    logits_BxKxGxLxS = _logits(q, k, mask_BxLxS, logits_cap)
    probs_BxKxGxLxS = _probs(logits_BxKxGxLxS, max_BxKxGxLx1, sum_BxKxGxLx1)
    d_out_BxKxGxLxDh = _pinned(d_out_BxLxKxGxDh.transpose(0, 2, 3, 1, 4))
    d_probs = jnp.einsum('bkgld,bksd->bkgls', d_out_BxKxGxLxDh.astype(v.dtype), v, preferred_element_type=jnp.float32)
    row_BxKxGxLx1 = jnp.sum(
        d_out_BxKxGxLxDh.astype(jnp.float32) * out_BxKxGxLxDh.astype(jnp.float32), axis=-1, keepdims=True
    )
    d_capped_BxKxGxLxS = probs_BxKxGxLxS * (d_probs - row_BxKxGxLx1)
    d_logits_BxKxGxLxS = jnp.where(
        mask_BxLxS[:, None, None], _through_soft_cap(d_capped_BxKxGxLxS, logits_BxKxGxLxS, logits_cap), 0.0
    )
    d_q_BxKxGxLxDh = jnp.einsum(
        'bkgls,bksd->bkgld', d_logits_BxKxGxLxS.astype(q.dtype), k, preferred_element_type=jnp.float32
    ) * (1 / math.sqrt(Dh))

    def transposed_product(small_BxKxGxLxDh: Array, big_BxKxGxLxS: Array) -> Array:
        """sum over (g, l) of small[..., l, d] * big[..., l, s] -> (B, S, K, Dh)."""
        small_BxKxDhxGL = _pinned(small_BxKxGxLxDh.transpose(0, 1, 4, 2, 3)).reshape(B, K, Dh, G * L)
        out_BxKxDhxS = jnp.einsum(
            'bkdx,bkxs->bkds',
            small_BxKxDhxGL.astype(big_BxKxGxLxS.dtype),
            big_BxKxGxLxS.reshape(B, K, G * L, -1),
            preferred_element_type=jnp.float32,
        )
        return out_BxKxDhxS.transpose(0, 3, 1, 2)

    d_v = transposed_product(d_out_BxKxGxLxDh, probs_BxKxGxLxS.astype(v.dtype))
    d_k = transposed_product(q, d_logits_BxKxGxLxS.astype(q.dtype))
    return (d_q_BxKxGxLxDh.transpose(0, 3, 1, 2, 4).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None)


attention.defvjp(_attention_fwd, _attention_bwd)


def plain_swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up, elementwise."""
    return jax.nn.silu(gate) * up


swiglu = jax.custom_vjp(plain_swiglu)  # the backward keeps only gate and up and recomputes the sigmoid


def _swiglu_fwd(gate: Array, up: Array):
    return plain_swiglu(gate, up), _as_bits((gate, up))


def _swiglu_bwd(residuals, d_out: Array):
    gate, up = _from_bits(residuals)
    sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32))
    silu = gate.astype(jnp.float32) * sigmoid
    d_out = d_out.astype(jnp.float32)
    d_gate = d_out * up.astype(jnp.float32) * sigmoid * (1 + gate.astype(jnp.float32) * (1 - sigmoid))
    return d_gate.astype(gate.dtype), (d_out * silu).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def plain_cross_entropy_sums(
    x_BxLxD: Array,
    w_DxV: Array,
    targets_BxL: Array,
    weights_BxL: Array,
    vocab_size: int,
    z_loss: float,
    chunks: int,
    logits_cap: float = 0.0,
) -> tuple[Array, Array]:
    """Logits x @ w (float32, soft-capped at `logits_cap`; 0: not capped), and over tokens t with
    weight w_t (float32, e.g. a 0/1 loss mask):

        (sum_t w_t * (CE_t + z_loss * logZ_t^2),  sum_t w_t * CE_t)

    CE_t = logZ_t - logit_t[target_t], logZ_t the log-sum-exp over the first `vocab_size`
    columns; the columns past it are padding and take no part. The second sum is a statistic:
    it has no gradient. The tokens go through in `chunks` slices of the L positions, one after
    another (`_over_length_chunks`), so (B, L / chunks, V) logits exist at a time, in the forward
    pass and, recomputed there by autodiff, in the backward (the hand-written backward recomputes
    nothing: it runs in the forward).
    """
    w_DxV = _padding_repeats_column_0(w_DxV, vocab_size)

    @jax.checkpoint
    def chunk_sums(x_BxCxD, w_DxV, targets_BxC, weights_BxC):
        return _cross_entropy(x_BxCxD, w_DxV, targets_BxC, weights_BxC, vocab_size, z_loss, logits_cap)[0]

    def chunk(sums, x_BxCxD, targets_BxC, weights_BxC):
        return _added(sums, chunk_sums(x_BxCxD, w_DxV, targets_BxC, weights_BxC)), None

    (loss, statistic), _ = _over_length_chunks(chunk, _ZERO_SUMS, chunks, x_BxLxD, targets_BxL, weights_BxL)
    return loss, jax.lax.stop_gradient(statistic)


cross_entropy_sums = jax.custom_vjp(plain_cross_entropy_sums, nondiff_argnums=(4, 5, 6, 7))


def _padding_repeats_column_0(w_DxV: Array, vocab_size: int) -> Array:
    """w with its padding columns (past vocab_size) set to column 0, so the max over all of a row's
    logits (a pass over them as they are, no masked copy) is the max over the real ones."""
    return jnp.where(jnp.arange(w_DxV.shape[-1]) < vocab_size, w_DxV, w_DxV[:, :1])


def _over_length_chunks(step: Callable, carry, chunks: int, *arrays_BxL: Array):
    """lax.scan of step(carry, *slices) -> (carry, out) over slices of the arrays' length axis
    (axis 1), as many as the largest divisor of the L / c positions of a context part that is at
    most `chunks` (c = sharding.context_parts(): 1 unless sequences are split over devices). Slice
    i holds the i-th consecutive run of every part, so each device computes its share of every
    slice. Returns the last carry and the outs joined back along the length axis."""
    B, L = arrays_BxL[0].shape[:2]
    c = context_parts()
    n = max(d for d in range(1, chunks + 1) if (L // c) % d == 0)

    def split(a_BxLx_: Array) -> Array:  # (n, B, L / n, ...)
        rest = a_BxLx_.shape[2:]
        return jnp.moveaxis(a_BxLx_.reshape(B, c, n, L // (c * n), *rest), 2, 0).reshape(n, B, L // n, *rest)

    def join(a_NxBxSx_: Array) -> Array:
        rest = a_NxBxSx_.shape[3:]
        return jnp.moveaxis(a_NxBxSx_.reshape(n, B, c, L // (c * n), *rest), 0, 2).reshape(B, L, *rest)

    carry, outs = jax.lax.scan(lambda c, slices: step(c, *slices), carry, tuple(map(split, arrays_BxL)))
    return carry, jax.tree.map(join, outs)


_ZERO_SUMS = (np.float32(0), np.float32(0))  # numpy: no device array at import


def _added(sums: tuple[Array, ...], more: tuple[Array, ...]) -> tuple[Array, ...]:
    return tuple(a + b for a, b in zip(sums, more))


def _cross_entropy(
    x_BxLxD: Array, w_DxV: Array, targets_BxL: Array, weights_BxL: Array, vocab_size: int, z_loss: float, cap: float
):
    """The two sums, and (exp(logits - max) (B, L, V) with 0 for padding, its sum, logZ, the
    logits soft-capped at `cap`); w's padding columns repeat column 0 (`_padding_repeats_column_0`)."""
    is_real_V = jnp.arange(w_DxV.shape[-1]) < vocab_size
    logits_BxLxV = soft_cap(_project_fwd(x_BxLxD, w_DxV, 1, jnp.float32)[0], cap)
    logits_BxLxV = constrain(logits_BxLxV, (Axis.BATCH, Axis.LENGTH, Axis.VOCAB))
    max_BxLx1 = jnp.max(logits_BxLxV, axis=-1, keepdims=True)
    exp_BxLxV = jnp.exp(logits_BxLxV + jnp.where(is_real_V, 0.0, -jnp.inf)[None, None, :] - max_BxLx1)
    sum_BxLx1 = jnp.sum(exp_BxLxV, axis=-1, keepdims=True)
    log_z_BxL = (max_BxLx1 + jnp.log(sum_BxLx1))[..., 0]
    target_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    cross_entropy_BxL = (log_z_BxL - target_BxL) * weights_BxL
    sums = (jnp.sum(cross_entropy_BxL + z_loss * weights_BxL * jnp.square(log_z_BxL)), jnp.sum(cross_entropy_BxL))
    return sums, (exp_BxLxV, sum_BxLx1, log_z_BxL, logits_BxLxV)


def _cross_entropy_fwd(
    x_BxLxD: Array,
    w_DxV: Array,
    targets_BxL: Array,
    weights_BxL: Array,
    vocab_size: int,
    z_loss: float,
    chunks: int,
    logits_cap: float = 0.0,
):
    """Per slice of the positions, d loss / d logits = w_t * ((1 + 2 z_loss logZ_t) softmax_t -
    onehot(target_t)) (times the soft cap's slope), then the head's backward (vrl.model.ops.project's)
    on it, the weight gradient summed over slices in float32: the residuals are the gradients for a
    cotangent of 1."""
    real_w_DxV = _padding_repeats_column_0(w_DxV, vocab_size)

    def chunk(carry, x_BxCxD, targets_BxC, weights_BxC):
        sums, d_w_DxV = carry
        chunk_sums, (exp_BxCxV, sum_BxCx1, log_z_BxC, logits_BxCxV) = _cross_entropy(
            x_BxCxD, real_w_DxV, targets_BxC, weights_BxC, vocab_size, z_loss, logits_cap
        )
        row_BxCx1 = (weights_BxC * (1 + 2 * z_loss * log_z_BxC))[..., None] / sum_BxCx1
        is_target_BxCxV = jnp.arange(exp_BxCxV.shape[-1])[None, None, :] == targets_BxC[..., None]
        d_capped_BxCxV = exp_BxCxV * row_BxCx1 - jnp.where(is_target_BxCxV, weights_BxC[..., None], 0.0)
        d_logits_BxCxV = _through_soft_cap(d_capped_BxCxV, logits_BxCxV, logits_cap)
        d_x_BxCxD, chunk_d_w_DxV = _project_grads(x_BxCxD, real_w_DxV, 1, d_logits_BxCxV)
        return (_added(sums, chunk_sums), d_w_DxV + chunk_d_w_DxV), d_x_BxCxD

    zeros = (_ZERO_SUMS, jnp.zeros(w_DxV.shape, jnp.float32))
    (sums, d_w_DxV), d_x_BxLxD = _over_length_chunks(chunk, zeros, chunks, x_BxLxD, targets_BxL, weights_BxL)
    return sums, (d_x_BxLxD, d_w_DxV.astype(w_DxV.dtype))


def _cross_entropy_bwd(vocab_size: int, z_loss: float, chunks: int, logits_cap: float, residuals, d_sums):
    del vocab_size, z_loss, chunks, logits_cap
    d_x, d_w = residuals
    d_loss = d_sums[0]
    return (d_loss * d_x).astype(d_x.dtype), (d_loss * d_w).astype(d_w.dtype), None, None


cross_entropy_sums.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# Which hand-written backwards each platform runs under model.hand_vjp=auto. CPU and TPU: all (each
# no worse than autodiff in the benchmarks; docs/performance.md). GPU (not measured): the ops whose
# saving is structural (kept residuals, passes over the logits); project's barriers only serve
# XLA:CPU's layouts, and cuBLAS takes transposed operands itself.
HAND_VJP_BY_PLATFORM = {'cpu': HAND_VJP_OPS, 'tpu': HAND_VJP_OPS, 'gpu': ('attention', 'swiglu', 'cross_entropy')}


@dataclasses.dataclass(frozen=True)
class HandVjpOps:
    """The model's hot operations as model.hand_vjp chooses: each with its hand-written backward or
    differentiated by autodiff (the same forward either way)."""

    project: Callable[..., Array]
    attention: Callable[..., Array]
    swiglu: Callable[..., Array]
    cross_entropy_sums: Callable[..., tuple[Array, Array]]


def choose_hand_vjp(setting: str, platform: str) -> tuple[str, str]:
    """(model.hand_vjp resolved for `platform` ('cpu', 'gpu', 'tpu'): 'all', 'none' or a comma list, why);
    vrl/model/resolve.py calls this."""
    if setting != 'auto':
        return setting, 'as configured'
    chosen = HAND_VJP_BY_PLATFORM.get(platform, HAND_VJP_OPS)
    return ('all' if chosen == HAND_VJP_OPS else ','.join(chosen) or 'none'), f'what pays on {platform}'


@functools.cache
def hand_vjp_ops(hand_vjp: str) -> HandVjpOps:
    """The ops for a resolved model.hand_vjp value ('all', 'none' or a comma list)."""
    names = () if hand_vjp == 'none' else HAND_VJP_OPS if hand_vjp == 'all' else hand_vjp.split(',')
    return HandVjpOps(
        project=project if 'project' in names else plain_project,
        attention=attention if 'attention' in names else plain_attention,
        swiglu=swiglu if 'swiglu' in names else plain_swiglu,
        cross_entropy_sums=cross_entropy_sums if 'cross_entropy' in names else plain_cross_entropy_sums,
    )
