"""The baselines and the later value-residual family: identities from the same weights, the cache
savings they promise, their parameters, and the config checks that keep combinations meaningful."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from tests.helpers import copy_params, random_tokens, randomize, rel_err, small_model_config
from vrl.core.config import ConfigError
from vrl.model import accounting, presets, variants
from vrl.model import cache as cache_lib
from vrl.model.decoder import Decoder


def _logits(model: Decoder, tokens) -> jnp.ndarray:
    return model(tokens)[..., : model.cfg.vocab_size]


@pytest.fixture(scope='module')
def vanilla() -> Decoder:
    model = Decoder(small_model_config(n_layers=4), rngs=nnx.Rngs(0))
    randomize(model, 1)
    return model


def _like(vanilla: Decoder, **overrides) -> Decoder:
    """A model of another variant holding vanilla's weights wherever it has the same parameter."""
    model = Decoder(small_model_config(n_layers=4, **overrides), rngs=nnx.Rngs(2))
    randomize(model, 3)  # its own parameters (gates, tables, ...) are random, not at their init
    copy_params(vanilla, model)
    return model


def test_denseformer_at_its_initialisation_is_vanilla(vanilla):
    tokens = random_tokens(4)
    dense = Decoder(small_model_config(n_layers=4, residual='dense'), rngs=nnx.Rngs(2))
    copy_params(vanilla, dense)  # every weight but the averaging weights, which stay at their init
    assert rel_err(_logits(dense, tokens), _logits(vanilla, tokens)) < 1e-6
    randomize(dense, 5)
    assert rel_err(_logits(dense, tokens), _logits(vanilla, tokens)) > 1e-3


@pytest.mark.parametrize('ways', ['qkvr', 'vr', 'r'])
def test_mudd_at_its_initialisation_is_vanilla_and_learns(vanilla, ways):
    """W_out = 0 and static weights on the newest output: every way is the block output, so with the k
    and v ways' norms scaled as the query's, the model is vanilla; a gradient step on MUDD's weights
    makes it another model."""
    tokens = random_tokens(5)
    mudd = Decoder(small_model_config(n_layers=4, residual='mudd', mudd_ways=ways), rngs=nnx.Rngs(2))
    copy_params(vanilla, mudd)  # every weight but MUDD's, which stay at their init
    for norm in (getattr(mudd.layers, f'{way}_input_norm', None) for way in 'kv'):
        if norm is not None:  # the random query norm's scale (theirs start at 1, as vanilla's does)
            norm.scale[...] = vanilla.layers.attn_norm.scale[...]
    assert rel_err(_logits(mudd, tokens), _logits(vanilla, tokens)) < 1e-6
    grads = nnx.to_pure_dict(nnx.grad(lambda m: jnp.mean(_logits(m, tokens) ** 2))(mudd))
    for name in ('w_out', 'static'):  # W_in's gradient is 0 until W_out moves
        assert all(float(jnp.abs(g).max()) > 0 for g in grads['mudd'][name].values())
    state = nnx.state(mudd, nnx.Param)
    nnx.replace_by_pure_dict(
        state, jax.tree.map(lambda p, g: p - 0.5 * g, nnx.to_pure_dict(state), grads, is_leaf=lambda x: x is None)
    )
    nnx.update(mudd, state)
    assert rel_err(_logits(mudd, tokens), _logits(vanilla, tokens)) > 1e-3


def test_mudd_parameters_have_the_authors_shapes():
    """After 0-based layer i: W_in (D, H_i), W_out (H_i, ways (i + 2)), static (ways, i + 2), r alone
    after the last layer, H_i the authors' JAX widths (rounded up past a multiple of 64, 4x on the last)."""
    cfg = small_model_config(n_layers=4, residual='mudd', mudd_ways='qkvr', mudd_layers=(2, 4))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(model.mudd, nnx.Param)))
    D = cfg.d_model
    assert shapes == {
        'w_in': {0: (D, 64), 1: (D, 64)},  # 4 ways x 3 inputs = 12 -> 64; 1 way x 5 inputs x 4 = 20 -> 64
        'w_out': {0: (64, 12), 1: (64, 5)},
        'static': {0: (4, 3), 1: (1, 5)},
    }
    assert (
        small_model_config(n_layers=16, residual='mudd', mudd_ways='qkvr').mudd_hidden(14) == 128
    )  # 4 x 16 = 64 -> 128


@pytest.mark.parametrize(
    'kind, dynamic, streams', [('hc', True, 4), ('hc', False, 3), ('mhc', True, 4), ('mhc', True, 2)]
)
def test_hyper_connections_at_their_initialisation_are_vanilla_and_learn(kind, dynamic, streams):
    """At init every sublayer adds its output to identical streams (hc: reading one of them; mhc: half of
    each), so with norms' eps negligible the model is vanilla (mhc's dynamic terms shut by their gates,
    which start at 0.01); a gradient step on the connections' weights makes it another model. (mhc's
    remix of identical streams is the identity, so its bias learns once the streams differ.)"""
    cfg = small_model_config(n_layers=4, norm_eps=1e-12)
    vanilla = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(vanilla, 1)
    tokens = random_tokens(10)
    hyper = Decoder(
        dataclasses.replace(cfg, residual=kind, hyper_dynamic=dynamic, hyper_streams=streams),
        rngs=nnx.Rngs(2),
    )
    copy_params(vanilla, hyper)  # every weight but the connections', which stay at their init
    connections = (hyper.first.attn_hyper, hyper.first.mlp_hyper, hyper.layers.attn_hyper, hyper.layers.mlp_hyper)
    if kind == 'mhc':
        assert rel_err(_logits(hyper, tokens), _logits(vanilla, tokens)) > 1e-4
        for c in connections:
            c.gates[...] = jnp.zeros_like(c.gates[...])
    assert rel_err(_logits(hyper, tokens), _logits(vanilla, tokens)) < 1e-6
    grads = nnx.to_pure_dict(nnx.grad(lambda m: jnp.mean(_logits(m, tokens) ** 2))(hyper))
    # the dynamic terms learn through W where it starts at zero (hc), through the gates where they are shut
    learned = ('static_post', 'w', 'static_res') if kind == 'hc' else ('static_post', 'gates')
    learned = learned if dynamic else ('static_post', 'static_res')
    for name in learned:
        assert float(jnp.abs(grads['layers']['attn_hyper'][name]).max()) > 0, name
    state = nnx.state(hyper, nnx.Param)
    nnx.replace_by_pure_dict(
        state, jax.tree.map(lambda p, g: p - 0.5 * g, nnx.to_pure_dict(state), grads, is_leaf=lambda x: x is None)
    )
    nnx.update(hyper, state)
    assert rel_err(_logits(hyper, tokens), _logits(vanilla, tokens)) > 1e-3


def test_neutreno_with_lambda_zero_is_vanilla(vanilla):
    tokens = random_tokens(6)
    assert rel_err(_logits(_like(vanilla, neutreno=True, neutreno_lambda=0.0), tokens), _logits(vanilla, tokens)) < 1e-6
    assert rel_err(_logits(_like(vanilla, neutreno=True), tokens), _logits(vanilla, tokens)) > 1e-3


@pytest.mark.parametrize('pinned, limit', [(0.0, 'vanilla'), (1.0, 'svformer')])
def test_per_token_mix_pinned_is_vanilla_or_svformer(vanilla, monkeypatch, pinned, limit):
    tokens = random_tokens(7)
    mix = _like(vanilla, attention='resformer', lambda_mode='per_token')
    reference = vanilla if limit == 'vanilla' else _like(vanilla, attention='svformer')
    assert rel_err(_logits(mix, tokens), _logits(reference, tokens)) > 1e-3  # unpinned, it is neither
    monkeypatch.setattr(variants, 'gate', lambda x, w, project: jnp.full((*x.shape[:2], w.shape[-1], 1), pinned))
    assert rel_err(_logits(mix, tokens), _logits(reference, tokens)) < 1e-6


def test_value_embeddings_with_gates_shut_are_vanilla(vanilla, monkeypatch):
    tokens = random_tokens(8)
    ve = _like(vanilla, value_embed_layers=(1, 2, 4), value_embed_tables=(0, 1, 0))
    assert rel_err(_logits(ve, tokens), _logits(vanilla, tokens)) > 1e-3
    monkeypatch.setattr(variants, 'gate', lambda x, w, project: jnp.zeros((*x.shape[:2], w.shape[-1], 1)))
    assert rel_err(_logits(ve, tokens), _logits(vanilla, tokens)) < 1e-6


def test_value_embeddings_tables_shared_as_configured():
    shared = Decoder(small_model_config(value_embed_layers=(1, 2, 3), value_embed_tables=(0, 0, 0)), rngs=nnx.Rngs(0))
    own = Decoder(small_model_config(value_embed_layers=(1, 2, 3)), rngs=nnx.Rngs(0))
    assert shared.value_embeds.tables.shape[0] == 1 and own.value_embeds.tables.shape[0] == 3
    assert shared.value_embeds.gates.shape[0] == own.value_embeds.gates.shape[0] == 3  # a gate per layer


def test_value_embeddings_gates_and_tables_learn():
    model = Decoder(
        small_model_config(value_embed_layers=(1, 3), attention='resformer', lambda_mode='per_token'), rngs=nnx.Rngs(0)
    )
    tokens = random_tokens(9)
    grads = nnx.to_pure_dict(nnx.grad(lambda m: jnp.mean(_logits(m, tokens) ** 2))(model))
    for g in (grads['value_embeds']['tables'], grads['value_embeds']['gates'], grads['layers']['attn']['w_mix']):
        assert float(jnp.abs(g).max()) > 0


def test_cla2_halves_the_allocated_cache_and_composes_with_gqa_and_svformer():
    def cache_bytes(**overrides) -> int:
        cfg = small_model_config(n_layers=6, n_heads=8, **({'n_kv_heads': 8} | overrides))
        return cache_lib.cache_bytes(cache_lib.init_cache(cfg, batch=3, max_len=32))

    vanilla = cache_bytes()
    assert cache_bytes(kv_share=2) * 2 == vanilla
    assert cache_bytes(kv_share=2, n_kv_heads=2) * 8 == vanilla  # CLA2 + GQA4
    assert cache_bytes(kv_share=3) * 3 == vanilla
    # SVFormer + CLA2: keys for 3 groups, values once: (3 + 1) / 12 of vanilla's 12 slots
    assert cache_bytes(attention='svformer', kv_share=2) * 12 == vanilla * 4


def test_svformer_gqa4_cache_is_about_an_eighth_of_vanilla_mha():
    cfg = small_model_config(n_layers=8, n_heads=8, n_kv_heads=2, attention='svformer')
    ratio = accounting.kv_cache_bytes_per_token(cfg) / accounting.kv_cache_bytes_per_token(accounting.vanilla_mha(cfg))
    assert ratio == (8 + 1) / (2 * 8) / 4  # 0.14, about 1/8


def test_cla_later_layers_have_no_key_or_value_projection():
    model = Decoder(small_model_config(n_layers=5, kv_share=2), rngs=nnx.Rngs(0))
    assert model.layers.attn.wk is None and model.layers.attn.wv is None
    assert model.shared_kv.wk.shape[0] == 2  # layers 3 and 5 own their K/V; 2 and 4 borrow


@pytest.mark.parametrize('size', ['tiny', '82m'])
def test_every_preset_builds_on_the_shipped_shapes(size):
    from configs import base, tiny
    from vrl.train.config import from_configdict

    config = from_configdict(tiny.get_config() if size == 'tiny' else base.get_config(f'vanilla,{size}'))
    models = {name: presets.apply(name, config.model) for name in presets.PRESETS}
    for cfg in models.values():
        assert accounting.account(cfg, 128).params > 0
    # the name tells distinct models apart (on tiny's 4 heads, gqa4 is mqa)
    assert len({cfg.variant_name for cfg in models.values()}) == len(set(models.values()))
    if size == '82m':  # every preset is a different model
        assert len(set(models.values())) == len(presets.PRESETS)
    sparse = presets.apply('resformer:sparse', config.model)
    assert sparse.sparse_layers[-1] == sparse.n_layers and sparse.lambda1 == 5.0
    # a preset sets the whole variant: nothing of another one leaks through
    dense_cla = dataclasses.replace(config.model, residual='dense', kv_share=2)
    assert presets.apply('resformer', dense_cla) == presets.apply('resformer', config.model)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(
        ConfigError, match="unknown variant preset 'resformer:learned'; did you mean 'resformer:learnable'"
    ):
        presets.apply('resformer:learned', small_model_config())
    assert 'svformer:gqa4' in presets.listing() and 'NeuTRENO' in presets.listing()


def test_neutreno_on_resformer_subtracts_the_values_attended(vanilla):
    """The paper's NeuTRENO + ResFormer: + 0.2 (V_1 - V_mix), V_mix = (V_1 + V_n) / 2. The first token attends
    only to itself, so there the attention output is V_mix + 0.2 (V_1 - V_mix) = 0.6 V_1 + 0.4 V_n by hand:
    the constant mix with those lambdas. Later tokens average over keys, so NeuTRENO is not a mix there."""
    tokens = random_tokens(8)
    stacked = _like(vanilla, **presets.PRESETS['resformer+neutreno'][1](vanilla.cfg))
    by_hand = _like(vanilla, attention='resformer', lambda_mode='constant', lambda1=0.6, lambda2=0.4)
    assert rel_err(_logits(stacked, tokens)[:, 0], _logits(by_hand, tokens)[:, 0]) < 1e-6
    assert rel_err(_logits(stacked, tokens)[:, 1:], _logits(by_hand, tokens)[:, 1:]) > 1e-3
    twice = _like(vanilla, attention='resformer', lambda_mode='constant', lambda1=0.7, lambda2=0.3)  # 0.2 (V_1 - V_n)
    assert rel_err(_logits(stacked, tokens)[:, 0], _logits(twice, tokens)[:, 0]) > 1e-3
