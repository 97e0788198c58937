"""The decoder: shapes, causality, scan == loop, variant identities, a float64 NumPy reference."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import numpy_reference
from tests.helpers import (
    ATTN_RES_VARIANTS,
    DISTINCT_PATHS,
    FAST_TIER,
    HYPER_VARIANTS,
    NAMED_VARIANTS,
    SKIP_V1_VARIANTS,
    cases,
    copy_params,
    random_tokens,
    randomize,
    rel_err,
    small_model_config,
    variant_params,
)
from vrl.core.config import ConfigError, from_dict
from vrl.model import attention, config, ops, presets
from vrl.model.decoder import Decoder
from vrl.model.residual import attnres, dense
from vrl.train import step
from vrl.train.config import Config
from vrl.train.rundir import checkpoint


def _loss_and_logits(model: Decoder, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = model(tokens)[..., : model.cfg.vocab_size]
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits


def _loss(model: Decoder, tokens: jax.Array) -> jax.Array:
    return _loss_and_logits(model, tokens)[0]


@pytest.mark.parametrize('variant', variant_params())
def test_shapes_dtypes_and_causality(variant):
    cfg = small_model_config(**variant)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, 1)
    tokens = random_tokens(2)
    t = 6
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 97)
    a, b = model(tokens), model(changed)
    chex.assert_shape(a, (2, 11, cfg.padded_vocab_size))
    chex.assert_type(a, jnp.float32)
    chex.assert_tree_all_finite(a)
    assert np.all(np.asarray(a[..., cfg.vocab_size :]) < -1e29)  # padded vocabulary entries are never predicted
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(b[:, :t]))
    assert not np.allclose(np.asarray(a[:, t:, :97]), np.asarray(b[:, t:, :97]))


def test_a_remat_policy_keeps_the_tensors_it_names():
    """model.remat=save_qkv keeps each rematted layer's queries, keys and attended values (the names
    Block gives them with checkpoint_name) for the backward pass, and no other named tensor of theirs;
    model.remat=full keeps none of them (layers unrolled, so their residuals are the function's)."""
    from jax._src.ad_checkpoint import saved_residuals

    tokens = random_tokens(4)

    def kept_names(remat: str) -> list[str]:
        model = Decoder(small_model_config(attention='resformer', remat=remat, scan_layers=False), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        kept = saved_residuals(lambda state: jnp.sum(nnx.merge(graphdef, state)(tokens)[..., :97] ** 2), state)
        names = (where.split("'")[1] for _, where in kept if where.startswith('named '))
        return sorted(name for name in names if name != 'v1')  # layer 1 runs outside remat: its V_1 is kept

    assert kept_names('save_qkv') == ['keys', 'keys', 'queries', 'queries', 'values', 'values']  # layers 2 and 3
    assert kept_names('full') == []


@pytest.mark.parametrize(
    'variant, remat',
    cases(
        {
            **{name: (v, 'none') for name, v in DISTINCT_PATHS.items()},
            'learnable_plus-full': (dict(attention='resformer', lambda_mode='learnable_plus'), 'full'),
            'svformer-save_dots': (dict(attention='svformer'), 'save_dots'),
            'resformer-save_qkv': (dict(attention='resformer', lambda_mode='learnable'), 'save_qkv'),
            'all-baselines-full': (NAMED_VARIANTS['all-baselines'], 'full'),
            'mudd-qkvr-full': (NAMED_VARIANTS['mudd-qkvr'], 'full'),
            'hc': (HYPER_VARIANTS['hc'], 'none'),
            'svformer-cla2-mhc-2-full': (HYPER_VARIANTS['svformer-cla2-mhc-2'], 'full'),
            'attnres-full-full': (ATTN_RES_VARIANTS['attnres-full'], 'full'),
            'attnres-block1-resformer': (ATTN_RES_VARIANTS['attnres-block1-resformer'], 'none'),
            'attnres-block2-svformer-cla2-full': (
                dict(attention='svformer', kv_share=2, residual='attnres', attn_residual_blocks=2),
                'full',
            ),
        },
        ('resformer-learnable_plus', 'all-baselines', 'svformer-save_dots'),
    ),
)
def test_scan_equals_loop(variant, remat):
    cfg = small_model_config(n_layers=4, remat=remat, **variant)
    scanned = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(scanned, 3)
    looped = Decoder(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(5))
    nnx.update(looped, nnx.state(scanned, nnx.Param))
    tokens = random_tokens(4)
    (_, scanned_logits), g_scan = nnx.value_and_grad(_loss_and_logits, has_aux=True)(scanned, tokens)
    (_, looped_logits), g_loop = nnx.value_and_grad(_loss_and_logits, has_aux=True)(looped, tokens)
    assert rel_err(looped_logits, scanned_logits) < 1e-5
    flat_scan = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g_scan)])
    flat_loop = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g_loop)])
    # attention residuals' backward runs a softmax over up to 2 L + 1 sources per sublayer, its sums in
    # another order in the loop: 7e-6 to 1.02e-5 measured on 4 layers (each path within 1.3e-6 of the
    # float64 reference's logits)
    assert rel_err(flat_loop, flat_scan) < (2e-5 if cfg.residual == 'attnres' else 1e-5)
    # per parameter too; a scalar like learnable_plus's s sums many terms in another order. A gradient
    # that is zero in exact arithmetic is rounding on both sides, compared against the largest: layer 1's
    # hyper-connection input weights only scale the identical streams that its pre-norm normalises
    largest = np.abs(flat_loop).max()
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(g_scan), jax.tree_util.tree_leaves_with_path(g_loop)
    ):
        assert rel_err(b, a) < 1e-4 or np.abs(np.asarray(b) - np.asarray(a)).max() < 1e-6 * largest, path


def test_cla_groups_scan_whole_with_the_borrowers_of_layer_1_before_and_a_short_group_after():
    """CLA3 over 7 layers: layers 2-3 borrow layer 1's K/V, one scanned group of 3 (layers 4-6), then a
    group of one (layer 7). Logits match the float64 reference, and the scan's gradients (remat full)
    match the loop's."""
    cfg = small_model_config(n_layers=7, kv_share=3, remat='full')
    scanned = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(scanned, 13)
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(scanned, nnx.Param)))
    tokens = np.asarray(random_tokens(14, B=1, L=9))
    logits = np.asarray(scanned(jnp.asarray(tokens)))[0, :, : cfg.vocab_size]
    assert rel_err(logits, numpy_reference.forward(cfg, params, tokens[0])) < 1e-4
    looped = Decoder(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(5))
    nnx.update(looped, nnx.state(scanned, nnx.Param))
    grads = [
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.grad(_loss)(m, jnp.asarray(tokens)))])
        for m in (scanned, looped)
    ]
    assert rel_err(grads[1], grads[0]) < 1e-5


def test_resformer_limits_are_vanilla_and_svformer():
    vanilla = Decoder(small_model_config(attention='vanilla'), rngs=nnx.Rngs(0))
    randomize(vanilla, 7)
    tokens = random_tokens(8)

    as_vanilla = Decoder(
        small_model_config(attention='resformer', lambda_mode='constant', lambda1=0.0, lambda2=1.0), rngs=nnx.Rngs(1)
    )
    copy_params(vanilla, as_vanilla)
    assert rel_err(as_vanilla(tokens)[..., :97], vanilla(tokens)[..., :97]) < 1e-6

    as_svformer = Decoder(
        small_model_config(attention='resformer', lambda_mode='constant', lambda1=1.0, lambda2=0.0), rngs=nnx.Rngs(1)
    )
    copy_params(vanilla, as_svformer)
    svformer = Decoder(small_model_config(attention='svformer'), rngs=nnx.Rngs(2))
    copy_params(vanilla, svformer)
    assert rel_err(as_svformer(tokens)[..., :97], svformer(tokens)[..., :97]) < 1e-6
    # and the two limits differ from each other, so the test can fail
    assert rel_err(svformer(tokens)[..., :97], vanilla(tokens)[..., :97]) > 1e-3


# soft caps low enough that most attention and final logits of randomize()d weights are bent by them
CAPS = dict(attn_logits_soft_cap=0.5, final_logits_soft_cap=1.0)
# a window of 3 of the 9 tokens in layers 1 and 3 of 3; layer 2 global
WINDOWS = dict(attention_window=3, global_layers=(2,))


@pytest.mark.parametrize(
    'variant',
    cases(
        {
            **NAMED_VARIANTS,
            **SKIP_V1_VARIANTS,
            'skipv1-windows': dict(WINDOWS, attention='vanilla', skip_v1=1),
            'vanilla-tied': dict(attention='vanilla', tie_embeddings=True),
            'resformer-qk_norm': dict(attention='resformer', lambda_mode='learnable_plus', qk_norm=True),
            'svformer-cla2-qk_norm': dict(attention='svformer', kv_share=2, qk_norm=True),
            'resformer-soft_caps': dict(CAPS, attention='resformer', lambda_mode='learnable_plus'),
            'svformer-qk_norm-soft_caps': dict(CAPS, attention='svformer', qk_norm=True),
            'resformer-windows': dict(WINDOWS, attention='resformer', lambda_mode='learnable_plus'),
            'svformer-cla2-windows': dict(WINDOWS, attention='svformer', kv_share=2),
            **HYPER_VARIANTS,
            **ATTN_RES_VARIANTS,
        },
        FAST_TIER
        + (
            'skipv1-cla2-value_embeds-qk_norm',
            'vanilla-tied',
            'svformer-cla2-qk_norm',
            'svformer-qk_norm-soft_caps',
            'svformer-cla2-windows',
            'mhc',
            'attnres-full',
            'attnres-block3-svformer-cla2',
        ),
    ),
)
def test_matches_float64_numpy_reference(variant):
    cfg = small_model_config(**variant)
    assert cfg.n_layers == 3
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, 11)
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tokens = np.asarray(random_tokens(12, B=2, L=9))
    logits = np.asarray(model(jnp.asarray(tokens)))[..., : cfg.vocab_size]
    for b in range(2):
        assert rel_err(logits[b], numpy_reference.forward(cfg, params, tokens[b])) < 1e-4


@pytest.mark.parametrize(
    'variant', cases(SKIP_V1_VARIANTS | ATTN_RES_VARIANTS, ('skipv1-resformer', 'attnres-block1-resformer'))
)
def test_gradients_match_the_float64_reference_along_a_random_direction(variant):
    """The model's gradient of the next-token loss (float32, autodiff and the hand-written backwards)
    along a random direction over every parameter equals the float64 NumPy forward's central
    difference along it: the new variants' backward is checked against an independent forward."""
    cfg = small_model_config(**variant)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, 21)
    tokens = np.asarray(random_tokens(22, B=1, L=9))[0]

    def reference_loss(params: dict) -> float:
        logits = numpy_reference.forward(cfg, params, tokens[:-1])
        top = logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        return float(np.mean(log_z - logits[np.arange(len(tokens) - 1), tokens[1:]]))

    def loss(m: Decoder) -> jax.Array:
        logits = m(jnp.asarray(tokens[None, :-1]))[0, :, : cfg.vocab_size]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[jnp.arange(len(tokens) - 1), tokens[1:]])

    grads = nnx.to_pure_dict(nnx.grad(loss)(model))
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(23)
    direction = jax.tree.map(lambda x: rng.standard_normal(x.shape), params)
    along = sum(float(np.sum(np.asarray(g, np.float64) * u)) for g, u in zip(*map(jax.tree.leaves, (grads, direction))))
    h = 1e-5
    step = lambda sign: jax.tree.map(lambda x, u: x + sign * h * u, params, direction)  # noqa: E731
    difference = (reference_loss(step(1)) - reference_loss(step(-1))) / (2 * h)
    assert abs(along - difference) < 1e-3 * abs(difference), (along, difference)


@pytest.mark.parametrize('variant', ['attnres-full', 'attnres-block1-resformer', 'attnres-block3-svformer-cla2'])
def test_attention_residuals_start_as_the_plain_residual(variant):
    """Zero queries weigh the sources alike: each sublayer's input is their mean, which its pre-norm makes
    the plain residual's (with eps far below the activations' scale); once the queries move, it is not."""
    cfg = small_model_config(norm_eps=1e-12, **ATTN_RES_VARIANTS[variant])
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    plain = Decoder(dataclasses.replace(cfg, residual='plain', attn_residual_blocks=0), rngs=nnx.Rngs(0))
    tokens = random_tokens(24)
    assert rel_err(model(tokens)[..., :97], plain(tokens)[..., :97]) < 1e-5
    model.layers.mlp_depth.query[...] = jax.random.normal(jax.random.key(25), model.layers.mlp_depth.query.shape)
    assert rel_err(model(tokens)[..., :97], plain(tokens)[..., :97]) > 1e-2


def test_the_depth_mix_and_its_hand_written_backward_match_float64_autodiff():
    """attnres.depth_mix (float32, its own VJP) against jax.grad of the plain softmax-and-sum in float64:
    random sources, their 1 / RMS and the query all random, two of seven sources unwritten (random
    values there too, which neither may read), cotangents on the mix and on the logsumexp."""
    keys = jax.random.split(jax.random.key(26), 5)
    sources, inv_rms = jax.random.normal(keys[0], (7, 2, 5, 16)), jax.random.uniform(keys[1], (7, 2, 5), minval=0.5)
    w, written = jax.random.normal(keys[2], (16,)), jnp.arange(7) < 5
    cotangents = jax.random.normal(keys[3], (2, 5, 16)), jax.random.normal(keys[4], (2, 5))

    def plain(sources, inv_rms, w):
        logits = jnp.where(written[:, None, None], jnp.einsum('sbld,d->sbl', sources, w) * inv_rms, -jnp.inf)
        return jnp.einsum('sbl,sbld->bld', jax.nn.softmax(logits, axis=0), sources), jax.nn.logsumexp(logits, axis=0)

    out, vjp = jax.vjp(lambda *a: attnres.depth_mix(*a, written), sources, inv_rms, w)
    grads = vjp(cotangents)
    with jax.enable_x64(True):
        as64 = lambda tree: jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.float64), tree)  # noqa: E731
        ref_out, ref_vjp = jax.vjp(plain, *as64((sources, inv_rms, w)))
        ref_grads = ref_vjp(as64(cotangents))
    for got, want in zip((*out, *grads), (*ref_out, *ref_grads)):
        assert got.dtype == jnp.float32 and rel_err(got, want) < 2e-6
    assert np.all(np.asarray(grads[0][5:]) == 0)  # the unwritten sources get no gradient


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_buffer_sum_and_its_hand_written_backward_match_float64_autodiff(dtype):
    """dense.buffer_sum (DenseFormer's and MUDD's mix of a scanned history, its own VJP) against jax.grad
    of the einsum in float64: random per-position weights, history and cotangent; in bfloat16 the
    history and its gradient round to bfloat16 (the weights and their gradient stay float32)."""
    keys = jax.random.split(jax.random.key(27), 3)
    weights, blocks = jax.random.normal(keys[0], (2, 5, 6)), jax.random.normal(keys[1], (6, 2, 5, 16)).astype(dtype)
    cotangent = jax.random.normal(keys[2], (2, 5, 16)).astype(dtype)
    out, vjp = jax.vjp(dense.buffer_sum, weights, blocks)
    grads = vjp(cotangent)
    with jax.enable_x64(True):
        as64 = lambda tree: jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), tree)  # noqa: E731
        ref_out, ref_vjp = jax.vjp(lambda w, b: jnp.einsum('blj,jbld->bld', w, b), *as64((weights, blocks)))
        ref_grads = ref_vjp(as64(cotangent))
    tolerance = 2e-6 if dtype == 'float32' else 8e-3  # bfloat16's rounding of the outputs, 2^-8
    for got, want, wanted_dtype in zip((out, *grads), (ref_out, *ref_grads), (dtype, 'float32', dtype)):
        assert got.dtype == wanted_dtype and rel_err(got, want) < tolerance


def test_learnable_lambdas_get_gradients_fixed_ones_are_not_parameters():
    for mode, names in (('learnable', {'v1', 'vn'}), ('learnable_plus', {'vn', 'w', 's'})):
        model = Decoder(small_model_config(attention='resformer', lambda_mode=mode), rngs=nnx.Rngs(0))
        grads = nnx.to_pure_dict(nnx.grad(_loss)(model, random_tokens(13)))['lambdas']
        assert set(grads) == names
        for name, g in grads.items():
            assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0), (mode, name)
    for mode in ('identity', 'constant', 'sparse'):
        cfg = small_model_config(attention='resformer', lambda_mode=mode, sparse_layers=(2,))
        params = nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param))
        assert 'lambdas' not in params, mode


# the hyper-connections' own arithmetic once per kind (the composed ones add only what DISTINCT_PATHS runs)
@pytest.mark.parametrize(
    'variant',
    cases(
        DISTINCT_PATHS | {name: HYPER_VARIANTS[name] for name in ('hc', 'mhc')},
        ('resformer-learnable_plus', 'all-baselines'),
    ),
)
def test_bfloat16_gradients_finite(variant):
    model = Decoder(small_model_config(compute_dtype='bfloat16', **variant), rngs=nnx.Rngs(0))
    loss, grads = nnx.value_and_grad(_loss)(model, random_tokens(14))
    assert np.isfinite(float(loss))
    chex.assert_tree_all_finite(grads)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_v1_is_not_detached():
    """Layer-1's W_V gets gradient through the layers >= 2 that read V_1 (SVFormer: only that)."""
    cfg = small_model_config(attention='svformer')
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = random_tokens(15)

    def loss_without_layer1_output(m):
        # Scale layer 1's own attention output to zero contribution via W_O: any gradient left
        # on W_V^1 must come from the later layers through V_1.
        m.first.attn.wo[...] = jnp.zeros_like(m.first.attn.wo[...])
        return _loss(m, tokens)

    grads = nnx.grad(loss_without_layer1_output)(model)
    assert float(jnp.abs(grads['first']['attn']['wv'][...]).max()) > 0


@pytest.mark.parametrize(
    'overrides, field, allowed',
    [
        (dict(attention='mamba'), 'model.attention', "'vanilla', 'resformer', 'svformer'"),
        (dict(n_heads=8, n_kv_heads=3), 'model.n_kv_heads', 'a divisor of model.n_heads=8'),
        (dict(attention='resformer', lambda_mode='sparse', sparse_layers=(9,)), 'model.sparse_layers', '2..3'),
        (dict(remat='some'), 'model.remat', "'none', 'full', 'save_dots'"),
        (dict(lambda_mode='learned'), 'model.lambda_mode', "'identity', 'constant'"),
        (dict(attention_chunks=0), 'model.attention_chunks', 'an integer >= 1'),
        (dict(head_chunks=0), 'model.head_chunks', 'an integer >= 1'),
        (dict(final_logits_soft_cap=-15.0), 'model.final_logits_soft_cap', 'a cap > 0, or 0 for none'),
        (dict(global_layers=(2,)), 'model.global_layers', 'with model.attention_window > 0'),
        (dict(attention_window=8, global_layers=(4,)), 'model.global_layers', '1-based layer indices in 1..3'),
        (dict(hand_vjp='project,flash'), 'model.hand_vjp', "'auto', 'all', 'none' or a comma-separated list of"),
        # combinations of variants that mean nothing
        (dict(attention='resformer', kv_share=2), 'model.kv_share', "1 with model.attention='resformer'"),
        (dict(kv_share=0), 'model.kv_share', 'an integer >= 1'),
        (dict(skip_v1=2), 'model.skip_v1', 'a number of value heads below model.n_kv_heads=2'),
        (dict(attention='svformer', skip_v1=1), 'model.skip_v1', "0 with model.attention='svformer'"),
        (dict(skip_v1=1, value_embed_layers=(1, 2)), 'model.skip_v1', '0 with value embeddings beyond layer 1'),
        (dict(attention='resformer', lambda_mode='per_token', skip_v1=1), 'model.skip_v1', 'or the per-token mix'),
        (dict(attention='svformer', neutreno=True), 'model.neutreno', "False with model.attention='svformer'"),
        (dict(value_embed_layers=(0, 2)), 'model.value_embed_layers', 'in 1..3'),
        (dict(value_embed_layers=(2, 2)), 'model.value_embed_layers', 'distinct'),
        (dict(attention='svformer', value_embed_layers=(2,)), 'model.value_embed_layers', 'layer 1 only for SVFormer'),
        (dict(kv_share=2, value_embed_layers=(2,)), 'model.value_embed_layers', 'layers 1, 3, ...'),
        (dict(value_embed_layers=(1, 2), value_embed_tables=(0,)), 'model.value_embed_tables', 'one table id per'),
        (dict(value_embed_layers=(1, 2), value_embed_tables=(0, 2)), 'model.value_embed_tables', 'every id 0..T-1'),
        (dict(lambda_mode='per-token'), 'model.lambda_mode', "'per_token'"),
        (dict(residual='dense_former'), 'model.residual', "'plain', 'dense', 'mudd', 'hc', 'mhc', 'attnres'"),
        (dict(residual='mudd', mudd_ways='qkv'), 'model.mudd_ways', "'r', 'vr', 'qkvr'"),
        (dict(mudd_layers=(2,)), 'model.mudd_layers', "its default, (), with model.residual='plain'"),
        (dict(residual='dense', mudd_ways='r'), 'model.mudd_ways', "it is a field of model.residual='mudd'"),
        (dict(residual='mudd', mudd_ways='r', mudd_layers=(4,)), 'model.mudd_layers', 'in 1..3'),
        (dict(attention='svformer', residual='mudd', mudd_ways='vr'), 'model.mudd_ways', "'r' with model.attention="),
        (dict(kv_share=2, residual='mudd'), 'model.mudd_ways', "'r' with model.kv_share=2"),
        (dict(residual='mHC'), 'model.residual', "'hc', 'mhc'"),
        (dict(residual='hc', hyper_streams=0), 'model.hyper_streams', 'an integer >= 1'),
        (dict(hyper_streams=2), 'model.hyper_streams', "a field of model.residual='hc' or 'mhc'"),
        (dict(residual='mhc', hyper_dynamic=False), 'model.hyper_dynamic', "True with model.residual='mhc'"),
        (dict(residual='attnres', attn_residual_blocks=2), 'model.attn_residual_blocks', 'a divisor of model.n_la'),
        (dict(residual='mudd', attn_residual_blocks=3), 'model.attn_residual_blocks', "with model.residual='mudd'"),
    ],
)
def test_bad_config_names_field_and_allowed_values(overrides, field, allowed):
    with pytest.raises(ConfigError) as e:
        small_model_config(**overrides)
    assert field in str(e.value) and allowed in str(e.value)


@pytest.mark.parametrize(
    'old, preset',
    [
        (dict(denseformer=True), 'denseformer'),
        (dict(mudd='vr'), 'mudd:vr'),
        (dict(hyper_connections='mhc'), 'mhc'),
        (dict(attn_residuals='full'), 'attnres'),
        (dict(attn_residuals='block', attn_residual_blocks=3), 'attnres:block'),
        ({}, 'vanilla'),
    ],
)
def test_a_config_from_before_model_residual_reads_as_today_s(old, preset, monkeypatch, caplog):
    """A model section written with each method's own switch (config.json, a study record, a checkpoint's
    saved config) is read as model.residual and the method's fields, said once; a resume compares it in
    today's fields."""
    monkeypatch.setattr(config, '_said_upgraded', set())
    today = presets.apply(preset, small_model_config())
    written = {**config.before_residual(dataclasses.asdict(small_model_config())), **old}
    for _ in range(2):
        assert from_dict(Config, {'model': written}).model == today
    said = [r.getMessage() for r in caplog.records if 'is read as model.residual=' in r.getMessage()]
    assert len(said) == (1 if old else 0) and (not old or f'model.residual={today.residual!r}' in said[0])
    checkpoint.check_model({'model': written}, today, 'the checkpoint')
    other = presets.apply('hc' if preset != 'hc' else 'mhc', small_model_config())
    with pytest.raises(checkpoint.CheckpointMismatchError, match='model.residual='):
        checkpoint.check_model({'model': written}, other, 'the checkpoint')


def test_every_residual_method_in_the_config_has_a_module_and_back():
    """vrl/model/config.py's RESIDUAL_FIELDS (the schema) and vrl/model/residual/'s METHODS (the modules) name
    the same methods, in the same order."""
    from vrl.model import residual

    assert tuple(residual.METHODS) == tuple(config.RESIDUAL_FIELDS)


def test_a_config_from_before_model_residual_choosing_two_methods_is_refused():
    with pytest.raises(ConfigError, match="model.mudd='vr', model.hyper_connections='hc'.* choose mudd and hc"):
        from_dict(Config, {'model': {'mudd': 'vr', 'hyper_connections': 'hc'}})
    with pytest.raises(ConfigError, match="choose dense beside model.residual='mhc'"):
        from_dict(Config, {'model': {'denseformer': True, 'residual': 'mhc'}})


@pytest.mark.parametrize('chunks', cases({'2': 2, '3': 3, '7': 7, '9': 9}, ('3', '9')))
def test_causal_chunks_match_one_pass(chunks):
    """Chunked training attention (uneven chunks, and more chunks than tokens) == one pass,
    values and gradients, with packed documents."""
    B, L, H, K, Dh = 2, 7, 4, 2, 8
    keys = jax.random.split(jax.random.key(chunks), 4)
    q, r = jax.random.normal(keys[0], (B, L, H, Dh)), jax.random.normal(keys[3], (B, L, H, Dh))
    k, v = jax.random.normal(keys[1], (B, L, K, Dh)), jax.random.normal(keys[2], (B, L, K, Dh))
    mask = attention.Causal(jnp.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2]]))

    def loss(q, k, v, n):
        return jnp.sum(attention.attention('xla', q, k, v, mask, n) * r)

    one, one_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, 1)
    chunked, chunked_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, chunks)
    assert abs(float(chunked - one)) / abs(float(one)) < 1e-6
    for a, b in zip(chunked_grads, one_grads):
        assert rel_err(a, b) < 1e-6


def test_hand_written_backwards_equal_autodiff_in_the_train_loss():
    """model.hand_vjp changes how gradients are computed, never their values: every choice equals
    autodiff on the train loss (a model with every op and gate: the per-token mix, value
    embeddings, NeuTRENO), and the choice reaches the traced program."""
    cfg = small_model_config(
        attention='resformer',
        lambda_mode='per_token',
        value_embed_layers=(1, 3),
        neutreno=True,
        attention_chunks=2,
        head_chunks=3,
    )
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, 12)
    tokens = random_tokens(13, L=13)  # 12 positions: 3 head slices
    batch = {
        'inputs': tokens[:, :-1],
        'targets': tokens[:, 1:],
        'loss_mask': jax.random.bernoulli(jax.random.key(14), 0.8, tokens[:, 1:].shape),
    }

    def loss_and_grads(hand_vjp: str):
        graphdef = nnx.graphdef(Decoder(dataclasses.replace(cfg, hand_vjp=hand_vjp), rngs=nnx.Rngs(0)))
        params = nnx.state(model, nnx.Param)
        loss = lambda p: step.loss_sums(graphdef, p, batch, 1e-3)[0]  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params), str(jax.make_jaxpr(loss)(params)).count('custom_vjp_call')

    (want_loss, want), custom_calls = loss_and_grads('none')
    assert custom_calls == 0
    calls = {}
    for hand_vjp in ('all', 'project,swiglu', 'attention,cross_entropy'):
        (loss, grads), calls[hand_vjp] = loss_and_grads(hand_vjp)
        assert abs(float(loss - want_loss)) / abs(float(want_loss)) < 1e-6
        for (path, got), (_, ref) in zip(
            jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(want)
        ):
            assert rel_err(got, ref) < 1e-4, (hand_vjp, path)
    assert calls['all'] > max(calls['project,swiglu'], calls['attention,cross_entropy']) > 0


def test_hand_vjp_auto_resolves_per_platform():
    assert ops.choose_hand_vjp('project,swiglu', 'tpu')[0] == 'project,swiglu'  # an explicit choice stands
    for platform, names in ops.HAND_VJP_BY_PLATFORM.items():
        resolved, _ = ops.choose_hand_vjp('auto', platform)
        chosen = ops.hand_vjp_ops(resolved)
        assert (chosen.project is ops.project) == ('project' in names)
        assert (chosen.swiglu is ops.swiglu) == ('swiglu' in names)
        assert (chosen.attention is ops.attention) == ('attention' in names)
        assert (chosen.cross_entropy_sums is ops.cross_entropy_sums) == ('cross_entropy' in names)


@pytest.mark.parametrize('hand_vjp', ['all', 'none'])
def test_the_training_loss_is_the_cross_entropy_of_the_logits_decoding_sees(hand_vjp):
    """With both soft caps on, the train step's loss (the head fused with the loss, in slices) is the
    cross-entropy of the capped logits that decoding, scoring and evaluation read (Decoder.logits)."""
    model = Decoder(
        small_model_config(attention='svformer', hand_vjp=hand_vjp, head_chunks=3, **CAPS), rngs=nnx.Rngs(0)
    )
    randomize(model, 6)
    tokens, targets = random_tokens(30, B=2, L=9), random_tokens(31, B=2, L=9)
    mask = jnp.ones_like(tokens).at[1, :3].set(0)
    graphdef, params = nnx.split(model, nnx.Param)
    loss, statistic = step.loss_sums(graphdef, params, {'inputs': tokens, 'targets': targets, 'loss_mask': mask}, 0.0)
    log_probs = jax.nn.log_softmax(model(tokens)[..., : model.cfg.vocab_size], axis=-1)
    want = -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0] * mask)
    assert abs(float(loss) - float(want)) / float(want) < 1e-5 and float(statistic) == pytest.approx(float(loss))


@pytest.mark.parametrize(
    'variant', cases({name: NAMED_VARIANTS[name] for name in (*FAST_TIER, 'resformer-per_token')}, FAST_TIER)
)
def test_a_packed_row_with_document_masking_equals_each_document_alone(variant):
    """Three documents packed into one row as the pipeline packs them with data.document_masking
    (segment ids, positions restarting at each document): their logits and their loss equal those of
    each document run alone from position 0, RoPE included."""
    model = Decoder(small_model_config(**variant), rngs=nnx.Rngs(0))
    randomize(model, 5)
    lengths = (5, 7, 4)
    documents = [random_tokens(20 + i, B=1, L=n) for i, n in enumerate(lengths)]
    packed = jnp.concatenate(documents, axis=1)
    segment_ids = jnp.concatenate([jnp.full((1, n), i + 1) for i, n in enumerate(lengths)], axis=1)
    positions = jnp.concatenate([jnp.arange(n)[None] for n in lengths], axis=1)
    # each document alone, padded at its end to the row's length: causal, so its own positions are untouched
    padded = [jnp.pad(d, ((0, 0), (0, packed.shape[1] - d.shape[1])), constant_values=1) for d in documents]
    forward = nnx.jit(lambda m, tokens, positions=None, segment_ids=None: m(tokens, positions, segment_ids))
    vocab = model.cfg.vocab_size  # the padded entries' -1e30 would hide any difference
    alone = jnp.concatenate([forward(model, p)[:, :n, :vocab] for p, n in zip(padded, lengths)], axis=1)
    assert rel_err(forward(model, packed, positions, segment_ids)[..., :vocab], alone) < 1e-5
    assert (
        rel_err(forward(model, packed)[..., :vocab], alone) > 1e-2
    )  # unmasked, the later documents see the earlier ones

    graphdef, params = nnx.split(model, nnx.Param)
    loss_sums = jax.jit(step.loss_sums, static_argnums=(0, 3))
    targets = jnp.concatenate([jnp.roll(d, -1, axis=1) for d in documents], axis=1)  # the next token of its document
    last = jnp.cumsum(jnp.array(lengths)) - 1
    loss_mask = jnp.ones_like(packed).at[0, last].set(0)
    packed_sum, _ = loss_sums(
        graphdef,
        params,
        {
            'inputs': packed,
            'targets': targets,
            'loss_mask': loss_mask,
            'positions': positions,
            'segment_ids': segment_ids,
        },
        0.0,
    )
    alone_sum = sum(
        loss_sums(
            graphdef,
            params,
            {
                'inputs': p,
                'targets': jnp.roll(p, -1, axis=1),
                'loss_mask': (jnp.arange(p.shape[1]) < n - 1)[None].astype(p.dtype),
            },
            0.0,
        )[0]
        for p, n in zip(padded, lengths)
    )
    assert rel_err(packed_sum, alone_sum) < 1e-5
