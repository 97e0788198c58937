"""Hyper-connections: the residual stream widened to n streams (model.residual='hc' or 'mhc', hyper_streams).

The hidden state between sublayers is n streams h_1..h_n (n, B, L, D), all the embedding output at
the start and summed before the final norm. Each sublayer (every layer's attention and its MLP) has
its own connection: per position, input weights `pre` (n,), output weights `post` (n,) and a remix
`res` (n, n), and

    input = sum_i pre_i h_i                       (then the sublayer's own pre-norm)
    h'_j  = sum_i res_ji h_i + post_j output      (res[dst, src])

- 'hc' (Zhu et al., arXiv 2409.19606, dynamic form): each stream, RMS-normalised over D with a learned
  scale, gives tanh(norm(h_i) W), W (D, n + 2): stream i's input weight, its row of remix weights (the
  weights of h_i in each h'_j) and its output weight, added to learned constants with learned gates
  (0.01 at init). The constants start as a standard residual: input from stream (2 layer + sublayer)
  mod n, res = I, post = 1; W = 0. The paper's norm is a LayerNorm; vrl's norms are RMSNorms.
- 'mhc' (DeepSeek, arXiv 2512.24880): the n streams RMS-normalised together (nD values, a learned
  scale), projected by phi (nD, 2n + n^2) to logits, each group times a learned gate (0.01 at init)
  plus a learned bias (0 at init): pre = sigmoid, post = 2 sigmoid, res = Sinkhorn-Knopp of exp
  (SINKHORN_ITERATIONS column-then-row normalisations, the paper's Eq. 9: each destination's weights,
  a row of res[dst, src], sum to 1 exactly, each source's up to the last pass's error). phi ~ N(0, 1 / nD).

model.hyper_dynamic=False keeps only hc's learned constants, the same at every position (mhc has no
static form: its biases start alike for every stream, and a doubly stochastic remix of identical
streams is the identity, so only the dynamic terms make the streams differ).

At init both kinds add each sublayer's output to identical streams, as a standard residual: the sum
of the streams is n times vanilla's hidden state, which the pre-norms and the final norm undo up to
their eps (mhc's dynamic terms start at 0.01 of their logits, hc's at zero). hc's one-hot input
weights make the streams' gradients differ from the first step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vrl.core.sharding import Axis
from vrl.model import ops, params
from vrl.model.config import ModelConfig
from vrl.model.residual.base import Plain

Array = jax.Array

SUBLAYERS = ('attn_hyper', 'mlp_hyper')  # each block's connections, attention's and MLP's
SINKHORN_ITERATIONS = 20  # DeepSeek's t_max
GATE_INIT = 0.01  # both papers' initial gate of the dynamic terms


class Coefficients(NamedTuple):
    """One sublayer's weights per position, float32."""

    pre_BxLxN: Array  # each stream's weight in the sublayer's input
    post_BxLxN: Array  # the sublayer output's weight in each stream
    res_BxLxNxN: Array  # [dst, src]: stream src's weight in stream dst

    def add(self, h_NxBxLxD: Array, out_BxLxD: Array) -> Array:
        """The streams after the sublayer: (n, B, L, D)."""
        dtype = h_NxBxLxD.dtype
        remixed = jnp.einsum('blji,ibld->jbld', self.res_BxLxNxN.astype(dtype), h_NxBxLxD)
        return remixed + jnp.einsum('bln,bld->nbld', self.post_BxLxN.astype(dtype), out_BxLxD.astype(dtype))


def sinkhorn(logits_NxN: Array, iterations: int = SINKHORN_ITERATIONS) -> Array:
    """A doubly stochastic matrix [destination, source] from logits over the last two axes, as the mHC
    paper's Eq. 9 makes it: exp, then `iterations` times columns and then rows scaled to sum to 1
    (M_t = T_r(T_c(M_{t-1}))), so each destination's weights (a row) sum to 1 exactly and each
    source's to 1 within what the iterations leave."""
    # the shift cancels in the first normalisation, so it carries no gradient
    m = jnp.exp(logits_NxN - jax.lax.stop_gradient(jnp.max(logits_NxN, axis=(-2, -1), keepdims=True)))
    for _ in range(iterations):
        m = m / jnp.sum(m, axis=-2, keepdims=True)
        m = m / jnp.sum(m, axis=-1, keepdims=True)
    return m


class HyperConnection(nnx.Module):
    """The connection of one kind of sublayer (`sublayer` 0: attention, 1: MLP) of layer 1 (`stack`
    None) or of the stacked layers 2..L (`stack` = L - 1, each parameter with a leading layers axis)."""

    def __init__(self, cfg: ModelConfig, *, sublayer: int, stack: int | None, rngs: nnx.Rngs):
        n, D, self.kind, self.eps = cfg.hyper_streams, cfg.d_model, cfg.residual, cfg.norm_eps
        if self.kind == 'hc':  # a standard residual that reads stream (2 layer + sublayer) mod n, as the paper
            layers = np.arange(1) if stack is None else np.arange(1, stack + 1)
            pre_SxN = np.eye(n)[(2 * layers + sublayer) % n]
            self.static_pre = (
                params.constant(pre_SxN[0], (None,)) if stack is None else params.constant(pre_SxN, (Axis.LAYERS, None))
            )
            self.static_res = params.constant(np.eye(n), (None, None), stack)
            self.static_post = params.constant(np.ones(n), (None,), stack)
        else:
            self.static_pre = params.constant(np.zeros(n), (None,), stack)
            self.static_res = params.constant(np.zeros((n, n)), (None, None), stack)
            self.static_post = params.constant(np.zeros(n), (None,), stack)
        dynamic = {
            'hc': lambda: (  # input and remix, output
                params.constant(np.ones(D), (Axis.EMBED,), stack),
                params.constant(np.zeros((D, n + 2)), (Axis.EMBED, None), stack),
                params.constant(np.full(2, GATE_INIT), (None,), stack),
            ),
            'mhc': lambda: (  # input, output, remix
                params.constant(np.ones((n, D)), (None, Axis.EMBED), stack),
                params.normal(rngs, (n, D, 2 * n + n * n), (None, Axis.EMBED, None), (n * D) ** -0.5, stack),
                params.constant(np.full(3, GATE_INIT), (None,), stack),
            ),
        }
        self.norm, self.w, self.gates = dynamic[self.kind]() if cfg.hyper_dynamic else (None, None, None)

    def coefficients(self, h_NxBxLxD: Array) -> Coefficients:
        n, B, L, _ = h_NxBxLxD.shape
        pre_BxLxN, post_BxLxN, res_BxLxNxN = (
            jnp.broadcast_to(x[...], (B, L, *x.shape)) for x in (self.static_pre, self.static_post, self.static_res)
        )
        if self.w is not None:
            w, scale, gates = self.w[...], self.norm[...], self.gates[...]
            if self.kind == 'hc':  # per stream: (B, L, n, n + 2) = [input weight, remix row, output weight]
                normed_NxBxLxD = ops.rms_normalized(h_NxBxLxD, self.eps) * scale[None, None, None]
                d_BxLxNxK = jnp.tanh(jnp.einsum('nbld,dk->blnk', normed_NxBxLxD, w))
                pre_BxLxN = pre_BxLxN + gates[0] * d_BxLxNxK[..., 0]
                res_BxLxNxN = res_BxLxNxN + gates[0] * jnp.swapaxes(d_BxLxNxK[..., 1 : n + 1], -1, -2)
                post_BxLxN = post_BxLxN + gates[1] * d_BxLxNxK[..., n + 1]
            else:  # all streams together: (B, L, 2n + n^2) = [input, output, remix logits]
                normed_NxBxLxD = ops.rms_normalized(h_NxBxLxD, self.eps, (0, -1)) * scale[:, None, None]
                d_BxLxK = jnp.einsum('nbld,ndk->blk', normed_NxBxLxD, w)
                pre_BxLxN = pre_BxLxN + gates[0] * d_BxLxK[..., :n]
                post_BxLxN = post_BxLxN + gates[1] * d_BxLxK[..., n : 2 * n]
                res_BxLxNxN = res_BxLxNxN + gates[2] * d_BxLxK[..., 2 * n :].reshape(B, L, n, n)
        if self.kind == 'mhc':
            pre_BxLxN, post_BxLxN = jax.nn.sigmoid(pre_BxLxN), 2 * jax.nn.sigmoid(post_BxLxN)
            res_BxLxNxN = sinkhorn(res_BxLxNxN)
        return Coefficients(pre_BxLxN, post_BxLxN, res_BxLxNxN)


def enter(connection: HyperConnection, h_NxBxLxD: Array) -> tuple[Array, Coefficients]:
    """A sublayer's input (B, L, D) before its pre-norm, the streams' weighted sum, and the weights to add
    its output with."""
    c = connection.coefficients(h_NxBxLxD)
    return jnp.einsum('bln,nbld->bld', c.pre_BxLxN.astype(h_NxBxLxD.dtype), h_NxBxLxD), c


class Hyper(Plain):
    """n streams; each sublayer reads their weighted sum and adds its output to their remix."""

    def block_params(self, *, first: bool, stack: int | None, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
        return {
            name: HyperConnection(self.cfg, sublayer=sublayer, stack=stack, rngs=rngs)
            for sublayer, name in enumerate(SUBLAYERS)
        }

    def begin(self, model: nnx.Module, embedded_BxLxD: Array, scanned: bool) -> tuple[Array, None]:
        return jnp.broadcast_to(embedded_BxLxD, (self.cfg.hyper_streams, *embedded_BxLxD.shape)), None

    def sublayer_input(
        self, block: nnx.Module, h: Array, history: None, layer: int | Array, sublayer: int
    ) -> tuple[Array, Coefficients]:
        return enter(getattr(block, SUBLAYERS[sublayer]), h)

    def add(
        self,
        block: nnx.Module,
        h: Array,
        history: None,
        out_BxLxD: Array,
        adding: Coefficients,
        layer: int | Array,
        sublayer: int,
    ) -> tuple[Array, None]:
        return adding.add(h, out_BxLxD), None

    def hidden(self, h: Array, history: None) -> Array:
        return jnp.sum(h, axis=0)  # the streams' sum

    def stream_axes(self, activation: tuple) -> tuple:
        return (None, *activation)

    def mix_macs(self) -> int:
        """Per sublayer (2 L): the dynamic weights (hc: W on each of the n streams, n D (n + 2); mhc: phi once,
        n D (2 n + n^2)) and the mixes: the input (n D), the remix (n^2 D) and the output added to each
        stream (n D)."""
        n, D = self.cfg.hyper_streams, self.cfg.d_model
        dynamic = {'hc': n * D * (n + 2), 'mhc': n * D * (2 * n + n * n)}[self.cfg.residual]
        return 2 * self.cfg.n_layers * ((dynamic if self.cfg.hyper_dynamic else 0) + (n * n + 2 * n) * D)

    def history_vectors(self) -> int:
        return self.cfg.hyper_streams - 1  # the streams beyond one
