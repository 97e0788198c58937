"""vrl's MUDD forward against the authors' PyTorch MUDDFormer module, on the same random weights.

    python bench/mudd_authors.py --authors PATH [--layers 4] [--seq_len 33] [--seeds 3]

PATH: the folder holding modeling_muddformer.py and configuration_muddformer.py of a checkout of
github.com/Caiyun-AI/MUDDFormer (pytorch/muddformer/); vrl ships none of it, and nothing here is
downloaded. Their model is built at a small shape in float32 with random weights everywhere (their
static weights dense_bs are drawn N(0, 1), so every mix is live), the weights are copied into vrl's
parameters, and both forwards' logits are compared by relative error. Their dense_type 'qkvr' is
vrl's residual='mudd', mudd_ways='qkvr'. Their PyTorch module runs no other: its single stream 'l' hands
the next block a one-element tuple that its norm cannot take, and it has no 'vr'; its attention repeats no kv heads,
so the shape is multi-head.

Two settings of theirs are changed to what vrl computes, each with their own code's options:
- their FeedForward widths grow with depth (scale_with_layer); vrl's d_ff is one width, so each
  layer's FeedForward is rebuilt with scale_with_layer=False, round128=False;
- their RoPE table is rounded to bfloat16 (precompute_freqs_cis); it is recomputed in float32.
Their round64 and expand_last are on, as in their JAX training code, which vrl's widths follow.

Needs requirements-extra.txt (torch, transformers) and einops.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from vrl.model.config import ModelConfig  # noqa: E402
from vrl.model.decoder import Decoder  # noqa: E402

try:
    import torch
except ImportError as e:
    raise SystemExit(f'this check needs torch ({e}): pip install -r requirements-extra.txt') from e


def load_authors(folder: Path):
    """Their modeling module, imported as the package it is written for (it imports its config relatively)."""
    for name in ('modeling_muddformer.py', 'configuration_muddformer.py'):
        if not (folder / name).is_file():
            raise SystemExit(f'--authors {folder}: no {name} there (give the pytorch/muddformer folder of a checkout)')
    spec = importlib.util.spec_from_file_location(
        'muddformer', folder / '__init__.py', submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules['muddformer'] = package
    return importlib.import_module('muddformer.modeling_muddformer')


def their_model(authors, layers: int, seed: int):
    torch.manual_seed(seed)
    config = authors.MUDDFormerConfig(
        block_size=64,
        vocab_size=256,
        n_layer=layers,
        n_head=4,
        n_local_heads=4,  # their attention repeats no kv heads: MHA only
        dim=64,
        intermediate_size=160,
        norm_eps=1e-5,
        is_training=True,  # no KV cache: a whole-sequence forward
        dense_type='qkvr',
        sepln=True,  # the q, k, v inputs normalised apart
        round64=True,
        expand_last=True,
        use_layer_cache=False,
    )
    model = authors.MUDDFormer(config).float().eval()
    for lidx, layer in enumerate(model.layers):
        layer.feed_forward = authors.FeedForward(config, lidx, round128=False, scale_with_layer=False)
    with torch.no_grad():  # every weight random, the norms' scales too
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 1 / p.shape[-1] ** 0.5) + (p.dim() == 1))
    model.setup_caches(1, 64, dtype=torch.float32)
    half = config.head_dim // 2
    inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(config.block_size, dtype=torch.float64)[:, None] * inv_freq[None]
    model.freqs_cis = torch.stack([angles.cos(), angles.sin()], -1).float()
    return config, model


def vrl_config(their) -> ModelConfig:
    return ModelConfig(
        attention='vanilla',
        residual='mudd',
        mudd_ways='qkvr',
        vocab_size=their.vocab_size,
        n_layers=their.n_layer,
        d_model=their.dim,
        n_heads=their.n_head,
        n_kv_heads=their.n_local_heads,
        head_dim=their.head_dim,
        d_ff=their.intermediate_size,
        norm_eps=their.norm_eps,
        rope_theta=their.rope_base,
        compute_dtype='float32',
        hand_vjp='none',
        attention_impl='xla',
    )


def their_weights(model, cfg: ModelConfig) -> dict:
    """vrl's parameter tree (a pure dict) filled with their weights."""
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    t = lambda w: w.detach().double().numpy()  # noqa: E731

    def block(layer, lidx: int) -> dict:
        a = layer.attention
        norms = [layer.attention_norm] if lidx == 0 else list(layer.attention_norms)
        out = {
            'attn_norm': {'scale': t(norms[0].weight)},
            'mlp_norm': {'scale': t(layer.ffn_norm.weight)},
            'mlp': {'w_gate': t(layer.feed_forward.w1.weight).T, 'w_up': t(layer.feed_forward.w3.weight).T},
        }
        out['mlp']['w_down'] = t(layer.feed_forward.w2.weight).T
        if lidx > 0:
            out['k_input_norm'], out['v_input_norm'] = {'scale': t(norms[1].weight)}, {'scale': t(norms[2].weight)}
        wq, wk, wv = t(a.wq.weight).T, t(a.wk.weight).T, t(a.wv.weight).T
        out['attn'] = {
            'wq': wq.reshape(D, H, Dh),
            'wk': wk.reshape(D, K, Dh),
            'wv': wv.reshape(D, K, Dh),
            'wo': t(a.wo.weight).T.reshape(H, Dh, D),
        }
        return out

    blocks = [block(layer, lidx) for lidx, layer in enumerate(model.layers)]
    connections = model.dynamic_dense
    return {
        'embed': t(model.tok_embeddings.weight),
        'first': blocks[0],
        'layers': jax.tree.map(lambda *xs: np.stack(xs), *blocks[1:]),
        'final_norm': {'scale': t(model.norm.weight)},
        'head': t(model.output.weight).T,
        'mudd': {
            'w_in': {i: t(c.w1.weight).T for i, c in enumerate(connections)},
            'w_out': {i: t(c.w2.weight).T for i, c in enumerate(connections)},
            'static': {i: t(b) for i, b in enumerate(model.dense_bs)},
        },
    }


def compare(authors, layers: int, seq_len: int, seed: int) -> float:
    their_cfg, model = their_model(authors, layers, seed)
    cfg = vrl_config(their_cfg)
    ours = Decoder(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(ours, nnx.Param)
    weights = their_weights(model, cfg)
    shapes = jax.tree.map(np.shape, nnx.to_pure_dict(state))
    got = jax.tree.map(np.shape, weights)
    if got != shapes:
        raise SystemExit(f'the weights do not map onto vrl: theirs {got}, vrl {shapes}')
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), weights))
    nnx.update(ours, state)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, seq_len))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens), return_tensor=True).double().numpy()
    mine = np.asarray(ours(jnp.asarray(tokens)), np.float64)[..., : cfg.vocab_size]
    return float(np.linalg.norm(mine - theirs) / np.linalg.norm(theirs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--authors', type=Path, required=True)
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--seq_len', type=int, default=33)
    parser.add_argument('--seeds', type=int, default=3)
    args = parser.parse_args()
    authors = load_authors(args.authors.resolve())
    print('| vrl mudd | theirs | layers | seed | logits rel. error (float32) |\n|---|---|---|---|---|')
    for seed in range(args.seeds):
        error = compare(authors, args.layers, args.seq_len, seed)
        print(f'| qkvr | qkvr | {args.layers} | {seed} | {error:.2e} |')


if __name__ == '__main__':
    main()
