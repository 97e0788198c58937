"""An independent float64 NumPy forward of the decoder and every variant, from docs/paper.md's equations.

Parameters come as the model's pure dict (numpy float64); nothing here calls vrl's code.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from vrl.model.config import ModelConfig


def _np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _np_rope(x, theta):  # x: L x N x Dh
    L, _, Dh = x.shape
    half = Dh // 2
    freq = theta ** (-np.arange(half) / half)
    ang = np.arange(L)[:, None] * freq[None, :]
    sin, cos = np.sin(ang)[:, None, :], np.cos(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _np_lambdas(cfg: ModelConfig, p: dict, n: int, x: np.ndarray) -> tuple:
    """(lambda_1, lambda_2) of model layer n + 2 (stacked index n): scalars, or (L, K, 1) per token."""
    mode = cfg.lambda_mode
    if mode == 'identity':
        return 0.5, 0.5
    if mode == 'constant':
        return cfg.lambda1, cfg.lambda2
    if mode == 'sparse':
        return (cfg.lambda1, cfg.lambda2) if n + 2 in cfg.sparse_layers else (0.0, 1.0)
    if mode == 'per_token':
        mix = _np_sigmoid(x @ p['layers']['attn']['w_mix'][n])[:, :, None]
        return mix, 1 - mix
    lam = p['lambdas']
    if mode == 'learnable':
        return lam['v1'][n], lam['vn'][n]
    w = lam['w'] - lam['w'].max()
    return lam['s'] * np.exp(w[n]) / np.exp(w).sum(), lam['vn'][n]


def _np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _np_kv_weights(cfg: ModelConfig, p: dict, n: int, layer: dict) -> tuple:
    """(W_K, W_V or None, QK-norm's key scale or None) of 0-based layer n, which owns a K/V group (CLA
    keeps stacked owners apart)."""
    if n == 0 or cfg.kv_share == 1:
        return layer['attn']['wk'], layer['attn'].get('wv'), layer['attn'].get('k_norm')
    owner = [m for m in range(1, cfg.n_layers) if m % cfg.kv_share == 0].index(n)
    shared = p['shared_kv']
    return tuple(None if shared.get(name) is None else shared[name][owner] for name in ('wk', 'wv', 'k_norm'))


def _np_qk_norm(x, scale, eps):  # x: L x N x Dh; each head's vector over Dh (QK-norm), or x without one
    return x if scale is None else _np_rms(x, scale, eps)


def _np_soft_cap(x, cap):  # cap * tanh(x / cap), or x for cap 0
    return cap * np.tanh(x / cap) if cap else x


def _np_value_embedding(cfg: ModelConfig, p: dict, n: int, x: np.ndarray, tokens: np.ndarray):
    """(the gate 2 sigmoid(x W_gate) (L, K, 1), table[token] (L, K, Dh)) for layer n + 1 if it has a
    value embedding, else None."""
    if n + 1 not in cfg.value_embed_layers:
        return None
    entry = cfg.value_embed_layers.index(n + 1)
    table = cfg.value_embed_tables[entry] if cfg.value_embed_tables else entry
    gate = 2 * _np_sigmoid(x @ p['value_embeds']['gates'][entry])[:, :, None]
    return gate, p['value_embeds']['tables'][table][tokens]


def _np_depth_weights(cfg: ModelConfig, p: dict) -> np.ndarray:
    """DenseFormer's (L, L + 1) weights: row i weighs the embedding and blocks 1..i+1, in row-major order."""
    L, flat = cfg.n_layers, list(p['depth_weights']['alpha'])
    alpha = np.zeros((L, L + 1))
    for i in range(L):
        for j in range(i + 2):
            alpha[i, j] = flat.pop(0)
    assert not flat
    return alpha


def _np_gelu(x):  # exact: 0.5 x (1 + erf(x / sqrt 2))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


def _np_mudd(cfg: ModelConfig, p: dict, n: int, blocks: list) -> dict | None:
    """MUDD's mixes after 0-based layer n, by way ('q', 'k', 'v', 'r'), or None without a connection
    there. blocks: the embedding output and the block outputs 1..n+1, each (L, D)."""
    connected = [m for m in range(cfg.n_layers) if not cfg.mudd_layers or m + 1 in cfg.mudd_layers]
    if cfg.residual != 'mudd' or n not in connected:
        return None
    ways = 'r' if n == cfg.n_layers - 1 else cfg.mudd_ways
    entry = connected.index(n)
    w_in, w_out, static = (p['mudd'][name][entry] for name in ('w_in', 'w_out', 'static'))
    newest = blocks[-1] / np.sqrt(np.mean(blocks[-1] ** 2, -1, keepdims=True) + cfg.norm_eps)
    weights = (_np_gelu(newest @ w_in) @ w_out).reshape(-1, len(ways), n + 2) + static  # (L, ways, n + 2)
    return {way: sum(weights[:, c, j, None] * b for j, b in enumerate(blocks)) for c, way in enumerate(ways)}


def _np_sinkhorn(logits, iterations=20):  # [dst, src]: exp, then columns and rows to sum 1 in turn (mHC Eq. 9)
    m = np.exp(logits - logits.max(axis=(-2, -1), keepdims=True))
    for _ in range(iterations):
        m = m / m.sum(-2, keepdims=True)
        m = m / m.sum(-1, keepdims=True)
    return m


def _np_hyper(cfg: ModelConfig, c: dict | None, h: np.ndarray) -> tuple:
    """A sublayer's input (L, D) and a function of its output giving the stream after it; h is (L, D), or
    the n streams (n, L, D) with hyper-connections, whose weights per position are computed here
    position by position from each paper's formulas."""
    if c is None:
        return h, lambda out: h + out
    n, L, D = h.shape
    inputs, remixes, posts = np.zeros((L, D)), np.zeros((L, n, n)), np.zeros((L, n))
    for t in range(L):
        pre, res, post = c['static_pre'].copy(), c['static_res'].copy(), c['static_post'].copy()  # res[dst, src]
        if 'w' in c and cfg.residual == 'hc':  # each stream i: tanh(norm(h_i) W) = [pre_i, res[:, i], post_i]
            for i in range(n):
                d = np.tanh(_np_rms(h[i, t], c['norm'], cfg.norm_eps) @ c['w'])
                pre[i] += c['gates'][0] * d[0]
                res[:, i] += c['gates'][0] * d[1 : n + 1]
                post[i] += c['gates'][1] * d[n + 1]
        elif 'w' in c:  # the streams flattened into one vector of n D values
            flat = h[:, t].reshape(-1)
            normed = flat / np.sqrt(np.mean(flat**2) + cfg.norm_eps) * c['norm'].reshape(-1)
            d = normed @ c['w'].reshape(n * D, -1)
            pre += c['gates'][0] * d[:n]
            post += c['gates'][1] * d[n : 2 * n]
            res += c['gates'][2] * d[2 * n :].reshape(n, n)
        if cfg.residual == 'mhc':
            pre, post, res = _np_sigmoid(pre), 2 * _np_sigmoid(post), _np_sinkhorn(res)
        inputs[t] = sum(pre[i] * h[i, t] for i in range(n))
        remixes[t], posts[t] = res, post
    return inputs, lambda out: np.einsum('tji,itd->jtd', remixes, h) + posts.T[:, :, None] * out[None]


class _NpDepth:
    """Attention residuals (Kimi team): the sources so far (the embedding output, then each completed one)
    and the partial sum of the sublayer outputs since the last, None when there is none."""

    def __init__(self, cfg: ModelConfig, embedded: np.ndarray):
        self.cfg, self.sources, self.partial = cfg, [embedded], None

    def mix(self, c: dict) -> np.ndarray:
        """softmax over the sources (and the partial sum) of w . RMSNorm(source), position by position."""
        V = np.stack(self.sources + ([] if self.partial is None else [self.partial]))  # (S, L, D)
        logits = np.einsum('sld,d->sl', _np_rms(V, c['key_scale'], self.cfg.norm_eps), c['query'])
        alpha = np.exp(logits - logits.max(0))
        return np.einsum('sl,sld->ld', alpha / alpha.sum(0), V)

    def enter(self, c: dict, n: int, sublayer: int) -> tuple:
        """_np_hyper's pair for 0-based layer n's attention (0) or MLP (1): its input, and a function of
        its output giving the partial sum after it (zeros once it became a source)."""

        def added(out):
            self.partial = out if self.partial is None else self.partial + out
            full = not self.cfg.attn_residual_blocks
            per_block = self.cfg.n_layers // max(self.cfg.attn_residual_blocks, 1)
            if full or (sublayer == 1 and (n + 1) % per_block == 0):
                self.sources, self.partial = self.sources + [self.partial], None
            return np.zeros_like(out) if self.partial is None else self.partial

        return self.mix(c), added


def forward(cfg: ModelConfig, p: dict, tokens: np.ndarray, trace: list | None = None) -> np.ndarray:
    """One sequence (L,) -> logits (L, vocab_size), straight from docs/paper.md's equations.

    With `trace`, appends per layer (attention (heads, L, L), attended values (L, K, Dh), output (L, D),
    the mean value-embedding gate or NaN).
    """
    L = tokens.shape[0]
    G = cfg.n_heads // cfg.n_kv_heads
    h = p['embed'][tokens]
    blocks = [h]
    depth = _NpDepth(cfg, h) if cfg.residual == 'attnres' else None
    if cfg.residual in ('hc', 'mhc'):
        h = np.stack([h] * cfg.hyper_streams)  # the n streams (n, L, D)
    v1 = group_kv = None
    ways = {}  # MUDD: the q, k, v inputs that the last connection mixed
    layers = [p['first']] + [jax.tree.map(lambda x, i=i: x[i], p['layers']) for i in range(cfg.n_stacked)]
    for n, layer in enumerate(layers):
        x, attention_added = (
            depth.enter(layer['attn_depth'], n, 0) if depth else _np_hyper(cfg, layer.get('attn_hyper'), h)
        )
        x = _np_rms(ways.get('q', x), layer['attn_norm']['scale'], cfg.norm_eps)
        # MUDD's k and v ways: every layer after the first normalises them with its own scale, mixed or not
        xk, xv = (
            _np_rms(ways.get(w, h), layer[f'{w}_input_norm']['scale'], cfg.norm_eps)
            if n and cfg.residual == 'mudd' and w in cfg.mudd_ways
            else x
            for w in 'kv'
        )
        a = layer['attn']
        q = _np_qk_norm(np.einsum('ld,dnh->lnh', x, a['wq']), a.get('q_norm'), cfg.norm_eps)
        q = _np_rope(q, cfg.rope_theta)
        if n % cfg.kv_share == 0:  # the first layer of a CLA group projects K and V
            wk, wv, k_norm = _np_kv_weights(cfg, p, n, layer)
            k = _np_rope(_np_qk_norm(np.einsum('ld,dkh->lkh', xk, wk), k_norm, cfg.norm_eps), cfg.rope_theta)
            v_n = v1 if wv is None else np.einsum('ld,dkh->lkh', xv, wv)  # SkipV1Former's: its first heads
        else:  # the others attend with its keys and values
            k, v_n = group_kv
        ve = _np_value_embedding(cfg, p, n, xv, tokens)
        if ve is not None:
            v_n = v_n + ve[0] * ve[1]
        if n == 0:
            v = v1 = v_n
        elif cfg.attention == 'svformer':
            v = v1
        elif cfg.attention == 'resformer' and n % cfg.kv_share == 0:
            lam1, lam2 = _np_lambdas(cfg, p, n - 1, xv)
            v = lam2 * v_n + lam1 * v1[:, : v_n.shape[1]]
        else:
            v = v_n
        if n and cfg.skip_v1 and n % cfg.kv_share == 0:  # SkipV1Former: V_1's last skip_v1 heads, as they are
            v = np.concatenate([v, v1[:, cfg.n_kv_heads - cfg.skip_v1 :]], axis=1)
        group_kv = (k, v) if n % cfg.kv_share == 0 else group_kv
        k_rep, v_rep = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # GQA by repetition here
        s = _np_soft_cap(np.einsum('inh,jnh->nij', q, k_rep) / np.sqrt(cfg.head_dim), cfg.attn_logits_soft_cap)
        i, j = np.arange(L)[:, None], np.arange(L)[None, :]
        local = cfg.attention_window > 0 and n + 1 not in cfg.global_layers  # a sliding window of keys
        s = np.where((j <= i) & ((i - j < cfg.attention_window) | (not local)), s, -np.inf)
        att = np.exp(s - s.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum('nij,jnh->inh', att, v_rep)
        if cfg.neutreno and n > 0:
            o = o + cfg.neutreno_lambda * np.repeat(v1 - v, G, axis=1)  # V_1 minus the values attended
        h = attention_added(np.einsum('inh,nhd->id', o, a['wo']))
        x, mlp_added = depth.enter(layer['mlp_depth'], n, 1) if depth else _np_hyper(cfg, layer.get('mlp_hyper'), h)
        x = _np_rms(x, layer['mlp_norm']['scale'], cfg.norm_eps)
        m = layer['mlp']
        gate, up = x @ m['w_gate'], x @ m['w_up']
        h = mlp_added((gate / (1 + np.exp(-gate)) * up) @ m['w_down'])
        blocks.append(h)
        if cfg.residual == 'dense':
            h = sum(w * b for w, b in zip(_np_depth_weights(cfg, p)[n], blocks))
        ways = _np_mudd(cfg, p, n, blocks) or {'r': h}  # after a layer without a connection, h for every input
        h = ways.pop('r')
        if trace is not None:
            hidden = sum(depth.sources) + (0 if depth.partial is None else depth.partial) if depth else h
            trace.append(
                (att, v, hidden if hidden.ndim == 2 else hidden.sum(0), np.nan if ve is None else ve[0].mean())
            )
    x = depth.mix(p['depth_output']) if depth else h if h.ndim == 2 else h.sum(0)
    x = _np_rms(x, p['final_norm']['scale'], cfg.norm_eps)
    head = p['embed'].T if cfg.tie_embeddings else p['head']
    return _np_soft_cap((x @ head)[:, : cfg.vocab_size], cfg.final_logits_soft_cap)
