"""Training attention implementations (vrl/model/attention.py): splash (in Pallas' interpreter on CPU)
against the XLA path for every variant, and how `auto` and explicit choices resolve."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import base, tiny
from tests.helpers import NAMED_VARIANTS, cases, randomize, rel_err, small_model_config
from vrl.core import sharding
from vrl.core.config import ConfigError, unresolved
from vrl.core.sharding import MeshConfig
from vrl.data.config import DataConfig
from vrl.model import attention, ops
from vrl.model import cache as cache_lib
from vrl.model.decoder import Decoder
from vrl.train import aot
from vrl.train.config import Config, TrainConfig, from_configdict
from vrl.train.step import TrainSteps

L = 128  # one splash block of the TPU's 128 lanes


def _documents(B: int, seed: int, length: int = L) -> jax.Array:
    """Segment ids of packed documents of random lengths, (B, length)."""
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(np.arange(1, length), size=(B, 3), replace=False), axis=1)
    return jnp.asarray((np.arange(length)[None, None] >= starts[:, :, None]).sum(1), jnp.int32)


# The kernel sees only q, k, v and the mask; these variants cover every way the model builds them
# (plain, V_1 shared across layers, K/V shared by CLA, per-token mixing, every baseline at once).
SPLASH_VARIANTS = ('vanilla', 'svformer-cla2', 'resformer-per_token', 'all-baselines')


@pytest.mark.parametrize(
    'name',
    cases({n: n for n in (*SPLASH_VARIANTS, 'svformer-cla2-windows')}, ['all-baselines', 'svformer-cla2-windows']),
)
def test_splash_matches_xla_in_the_model(name):
    """The whole model's loss and every parameter gradient, float32, GQA, packed documents; with
    windows (50 of 128 tokens, layer 2 global), splash's LocalMask in the layers the scan finds local."""
    windows = name.endswith('-windows')
    fields = dict(attention_window=50, global_layers=(2,)) if windows else {}
    cfg = small_model_config(**NAMED_VARIANTS[name.removesuffix('-windows')], **fields)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, seed=1)
    params = nnx.state(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (2, L), 0, cfg.vocab_size)
    segment_ids = _documents(2, seed=3)
    weights = jax.random.normal(jax.random.key(4), (2, L, cfg.d_model))

    def loss(params, impl):
        impl_model = nnx.merge(
            nnx.graphdef(Decoder(dataclasses.replace(cfg, attention_impl=impl), rngs=nnx.Rngs(0))), params
        )
        return jnp.sum(impl_model.hidden(tokens, None, segment_ids) * weights)

    (want, want_grads), (got, got_grads) = (
        jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, impl) for impl in ('xla', 'splash_interpret')
    )
    assert abs(float(got - want)) / abs(float(want)) < 1e-4
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        assert rel_err(a, b) < 1e-4 if np.any(b) else not np.any(a)  # the head takes no part in hidden()


CAPS = dict(attn_logits_soft_cap=0.5, final_logits_soft_cap=1.0)  # low: most logits are bent by them
WINDOWS = dict(attention_window=100, global_layers=(2,))  # of 256 tokens: layers 1 and 3 local


def _split_matches_one_device(name: str, impl: str, context: int, documents: bool, **fields):
    """The model's loss and gradients (float32, GQA) with each sequence of 2 x 256 tokens split over
    `context` devices, attention by `impl`, equal the XLA path's on one device; the split step, for
    what a test asks of its program."""
    cfg = small_model_config(**NAMED_VARIANTS[name], **fields)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, seed=1)
    params = nnx.state(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (2, 2 * L), 0, cfg.vocab_size)
    segment_ids = _documents(2, seed=3, length=2 * L) if documents else None
    weights = jax.random.normal(jax.random.key(4), (2, 2 * L, cfg.d_model))

    def loss(params, impl):
        impl_model = nnx.merge(
            nnx.graphdef(Decoder(dataclasses.replace(cfg, attention_impl=impl), rngs=nnx.Rngs(0))), params
        )
        return jnp.sum(impl_model.hidden(tokens, None, segment_ids) * weights)

    want, want_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, 'xla')
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, context=context), jax.devices()[:context])
    split = jax.jit(sharding.traced_in(mesh, jax.value_and_grad(loss)), static_argnums=1)
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    got, got_grads = split(params, impl)
    assert abs(float(got - want)) / abs(float(want)) < 1e-4
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        assert rel_err(a, b) < 1e-4 if np.any(b) else not np.any(a)
    return lambda: split.lower(params, impl)


@pytest.mark.parametrize(
    'name, fields', [('vanilla', {}), ('svformer', CAPS | WINDOWS)], ids=['vanilla', 'svformer-soft_caps-windows']
)
def test_splash_on_each_part_of_a_split_sequence_matches_xla(name, fields):
    """mesh.context=2: each device runs splash on its part of the sequence (every other token), its
    rows of the causal mask, over the gathered keys and values (SVFormer's layers >= 2: V_1's whole
    copies), with packed documents; with soft caps and windows, splash's own soft cap and each part's
    window against the XLA path's, the layer scan choosing each layer's kernels (local or global)."""
    lowered = _split_matches_one_device(name, 'splash_interpret', context=2, documents=True, **fields)
    assert 'stablehlo.case' in lowered().as_text()  # each part's own kernel


def test_soft_caps_and_windows_on_a_split_sequence_are_one_devices():
    """mesh.context=2 on the XLA path: each device caps its queries' logits over the gathered keys
    and, in the local layers, keeps the keys within its queries' windows."""
    _split_matches_one_device('resformer-learnable_plus', 'xla', context=2, documents=True, **CAPS, **WINDOWS)


def test_each_part_of_a_striped_split_keeps_the_same_splash_blocks():
    """Context 4 over 2,048 tokens: each part's computed splash mask (`_StripedRows`) is its rows of the
    causal mask over `balanced_order`, and every part keeps the same number of 128 x 128 blocks
    with a key seen; the plain split's last part keeps (2c - 1) / c of the average."""
    L, parts, block = 2048, 4, 128
    P = L // parts
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1, context=parts), jax.devices()[:parts])
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        order = attention.balanced_order(L)
    assert sorted(order.tolist()) == list(range(L)) and order[:5].tolist() == [0, 4, 8, 12, 16]

    def blocks(mask) -> int:
        return int(mask[:, :].reshape(P // block, block, L // block, block).any(axis=(1, 3)).sum())

    striped, plain = [], []
    for part in range(parts):
        rows = attention._StripedRows(part, parts, L)
        np.testing.assert_array_equal(rows[:, :], order[part * P : (part + 1) * P, None] >= order[None, :])
        striped.append(blocks(rows))
        plain.append(blocks(splash_mask.CausalMask((P, L), offset=part * P)))
    assert len(set(striped)) == 1, striped
    assert max(plain) / np.mean(plain) == pytest.approx((2 * parts - 1) / parts, rel=0.1), plain


@pytest.mark.parametrize('name', ['svformer-cla2', 'resformer-per_token'])
def test_cudnn_on_each_part_of_a_split_sequence_matches_xla(name, monkeypatch):
    """mesh.context=4 with attention_impl='cudnn': each device's queries attend in chunks over the
    keys up to each chunk's end, their mask given to jax.nn.dot_product_attention as cuDNN takes it
    (a (1, 1, rows, keys) bias). No GPU here, so the calls run on JAX's reference for them
    (implementation='xla')."""
    monkeypatch.setattr(attention, 'DOT_PRODUCT_ATTENTION', 'xla')
    masks = []  # the masks the calls were given, as each call is traced

    def recorded(*args, mask=None, **kwargs):
        masks.append(mask.shape)
        return dot_product_attention(*args, mask=mask, **kwargs)

    dot_product_attention = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, 'dot_product_attention', recorded)
    _split_matches_one_device(name, 'cudnn', context=4, documents=False)
    P = 2 * L // 4  # each device's queries, in 4 chunks, each over the keys up to its last query
    assert sorted(set(masks)) == [(1, 1, P // 4, 4 * P // 4 * chunk) for chunk in (1, 2, 3, 4)]


def test_splash_without_documents_and_multi_query():
    """The kernel alone, no segment ids, one kv head for four query heads, bfloat16 inputs."""
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (2, 256, 4, 64))
    k, v = (jax.random.normal(key, (2, 256, 1, 64)) for key in keys[1:])
    mask = attention.Causal(None)
    want = attention.attention('xla', q, k, v, mask, causal_chunks=1)
    got = attention.attention('splash_interpret', q, k, v, mask, causal_chunks=1)
    assert rel_err(got, want) < 1e-5
    got_bf16 = attention.attention('splash_interpret', *(x.astype(jnp.bfloat16) for x in (q, k, v)), mask, 1)
    assert rel_err(got_bf16.astype(jnp.float32), want) < 2e-2
    # a local layer's window: splash's LocalMask is vrl's
    local = attention.Causal(None, window=50, local=True)
    got_local = attention.attention('splash_interpret', q, k, v, local, 1)
    assert rel_err(got_local, attention.attention('xla', q, k, v, local, 1)) < 1e-5 and rel_err(got_local, want) > 0.1
    # soft-capped logits (the queries scaled up so that the cap bends most of them): splash's cap is vrl's
    capped = [attention.attention(impl, 4 * q, k, v, mask, 1, logits_cap=2.0) for impl in ('xla', 'splash_interpret')]
    assert (
        rel_err(capped[1], capped[0]) < 1e-5
        and rel_err(capped[0], attention.attention('xla', 4 * q, k, v, mask, 1)) > 0.1
    )


def test_auto_picks_each_platforms_kernel_and_says_why_not():
    """vrl/model/resolve.py, the one place an `auto` becomes a choice: each with its reason, said once."""
    model = small_model_config(head_dim=64, compute_dtype='bfloat16', attention_impl='auto', hand_vjp='auto')

    def resolved(platform: str, seq_len: int = 2048, masking: bool = False, **fields) -> tuple[str, list[str]]:
        said = []
        config = Config(
            model=dataclasses.replace(model, **fields), data=DataConfig(seq_len=seq_len, document_masking=masking)
        )
        out = aot.execution(config, platform, said.append)
        assert aot.execution(out, platform, said.append) == out  # idempotent, and silent the second time
        return out.model.attention_impl, said

    assert resolved('cpu')[0] == 'xla' and resolved('tpu', masking=True)[0] == 'splash'
    impl, said = resolved('gpu')
    assert impl == 'cudnn' and said == [
        'model.attention_impl=cudnn (auto on gpu: the gpu kernel serves this config)',
        'model.hand_vjp=attention,swiglu,cross_entropy (auto on gpu: what pays on gpu)',
    ]
    assert resolved('gpu', masking=True) == (
        'xla',
        [
            'model.attention_impl=xla (auto on gpu: cuDNN attention through JAX takes no segment ids '
            '(data.document_masking=True))',
            'model.hand_vjp=attention,swiglu,cross_entropy (auto on gpu: what pays on gpu)',
        ],
    )
    assert 'splash needs data.seq_len a multiple of 128' in resolved('tpu', seq_len=200)[1][0]
    assert 'needs model.compute_dtype=bfloat16 (it is float32)' in resolved('gpu', compute_dtype='float32')[1][0]
    assert resolved('gpu', attn_logits_soft_cap=50.0)[1][0] == (
        'model.attention_impl=xla (auto on gpu: cuDNN attention through JAX has no logit soft cap '
        '(model.attn_logits_soft_cap=50))'
    )


def test_a_model_runs_on_concrete_values_only_which_one_resolve_makes():
    """Every auto names itself where a model, a cache, a mesh or a train step would start on it; the
    run plan's one resolve leaves none (vrl.core.config.unresolved), and the model then runs."""
    autos = dict(attention_impl='auto', hand_vjp='auto', compute_dtype='auto', remat='auto')
    model = Decoder(small_model_config(**autos), rngs=nnx.Rngs(0))  # building (for shapes) is fine
    with pytest.raises(ConfigError) as refused:
        model(jnp.ones((1, 8), jnp.int32))
    assert str(refused.value).startswith(
        'model.attention_impl=auto, model.hand_vjp=auto, model.compute_dtype=auto, model.remat=auto unresolved: '
        'a Decoder that runs takes concrete values. vrl.train.aot.resolve resolves'
    )
    with pytest.raises(ConfigError, match=r'^model.attention_impl=auto, .* unresolved: a KV cache takes'):
        cache_lib.init_cache(model.cfg, 1, 8)
    decoding = Decoder(small_model_config(remat='auto'), rngs=nnx.Rngs(0))  # decoding never reads model.remat
    logits, _ = decoding.decode(
        jnp.ones((1, 3), jnp.int32), jnp.zeros((1,), jnp.int32), cache_lib.init_cache(decoding.cfg, 1, 8)
    )
    assert logits.shape == (1, 3, decoding.cfg.padded_vocab_size)
    config = Config(model=model.cfg, data=DataConfig(seq_len=8, batch_size=2), train=TrainConfig(microbatches=0))
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, context=0))
    assert unresolved(config, '') == [
        'model.attention_impl=auto',
        'model.hand_vjp=auto',
        'model.compute_dtype=auto',
        'model.remat=auto',
        'train.microbatches=0',
        'mesh.context=0',
    ]
    with pytest.raises(ConfigError, match=r'^model.attention_impl=auto, .*, mesh.context=0 unresolved: a TrainSteps'):
        TrainSteps(config, sharding.make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    resolved, _ = aot.resolve(config, jax.devices()[:1], None, lambda line: None)
    assert unresolved(resolved, '') == []
    model = Decoder(resolved.model, rngs=nnx.Rngs(0))
    assert model(jnp.ones((1, 8), jnp.int32)).shape == (1, 8, resolved.model.padded_vocab_size)


def test_an_explicit_choice_that_cannot_run_is_refused():
    cfg = small_model_config(head_dim=64, compute_dtype='bfloat16')
    with pytest.raises(
        ConfigError,
        match=r"model.attention_impl='cudnn' cannot run here: cuDNN attention runs on "
        r'NVIDIA GPUs \(this is cpu\)',
    ):
        attention.choose(dataclasses.replace(cfg, attention_impl='cudnn'), 'cpu', 2048, False)
    with pytest.raises(ConfigError, match=r"attention_impl='splash' cannot run here: splash needs data.seq_len"):
        attention.choose(dataclasses.replace(cfg, attention_impl='splash'), 'tpu', 1000, False)
    assert (
        attention.choose(dataclasses.replace(cfg, attention_impl='splash'), 'cpu', 1024, False)[0] == 'splash_interpret'
    )
    with pytest.raises(ConfigError, match=r"model.attention_impl='flash' is invalid"):
        small_model_config(attention_impl='flash')


def test_auto_fit_without_a_memory_limit_takes_the_cheapest_setting():
    config = from_configdict(base.get_config('svformer,82m'))
    assert (config.train.microbatches, config.model.remat) == (0, 'auto')  # the named configs fit themselves
    fitted, report = aot.auto_fit(config, jax.devices(), None)
    assert (fitted.train.microbatches, fitted.model.remat, report) == (1, 'none', None)
    assert aot.fit_line(fitted, report) == (
        'auto fit: train.microbatches=1, model.remat=none (device memory unknown, so the cheapest setting)'
    )
    explicit = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, microbatches=4),
        model=dataclasses.replace(config.model, remat='full'),
    )
    assert aot.auto_fit(explicit, jax.devices(), None) == (explicit, None)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason='libtpu is not installed (pip install "jax[tpu]"), so no TPU topology can be described',
)
def test_auto_fit_picks_the_fewest_microbatches_that_fit():
    """The tiny model, 8 sequences per v5e chip and no remat, against a memory limit set below what
    one step at once needs: auto takes the smallest count that fits, and the count below it does not.
    (The limit is the test's, so the candidates are small programs; the 82M 64K test uses the chip's.)"""
    config = from_configdict(tiny.get_config())
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, batch_size=32, seq_len=256),
        model=dataclasses.replace(config.model, remat='none'),
    )
    devices, _ = aot.tpu_devices('v5e:2x2')  # 8 sequences per chip: counts 1, 2, 4, 8
    config = aot.execution(config, 'tpu', lambda line: None)
    whole = aot.compile_train_step(config, devices, None).total_bytes  # one step at once
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=0))
    hbm = int(0.6 * whole / aot.FIT_MARGIN)
    said = []
    fitted, report = aot.auto_fit(config, devices, hbm, said.append)
    count = fitted.train.microbatches
    lines = '\n'.join(said)  # every candidate, as it compiles
    assert (
        f'auto fit: microbatches={count}, remat=none: {report.total_bytes / aot.GiB:.2f} of '
        f'{hbm / aot.GiB:.2f} GiB per device, fits' in lines
    )
    assert count > 1 and fitted.model.remat == 'none'
    assert report.total_bytes <= aot.FIT_MARGIN * hbm
    # the bisection ends between the count that fits and the one below it, which it compiled too
    assert re.search(rf'auto fit: microbatches={count // 2}, remat=none: .* does not fit', lines), lines


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason='libtpu is not installed (pip install "jax[tpu]"), so no TPU topology can be described',
)
def test_auto_context_splits_sequences_only_when_whole_ones_do_not_fit():
    """mesh.context=0 with one 512-token sequence per v5e chip, against a memory limit below what a
    whole sequence per chip needs: context 1 is compiled and refused; context 2 with 2 microbatches
    (half a sequence per chip at a time) fits, and the mesh's fsdp axis gives up the devices."""
    config = from_configdict(tiny.get_config())
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, batch_size=4, seq_len=512),
        model=dataclasses.replace(config.model, remat='none', attention_impl='xla', n_layers=2),
    )
    devices, _ = aot.tpu_devices('v5e:2x2')  # one host of 4 chips: context 1, 2 or 4
    whole = aot.compile_train_step(aot.execution(config, 'tpu', lambda line: None), devices, None).total_bytes
    hbm = int(0.9 * whole / aot.FIT_MARGIN)  # fits 90% of a whole sequence's need
    auto = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, microbatches=0),
        mesh=dataclasses.replace(config.mesh, context=0),
    )
    said = []
    fitted, report = aot.resolve(auto, devices, hbm, said.append)
    lines = '\n'.join(said)
    assert re.search(r'auto fit: mesh.context=1 does not fit \(the train step does not fit', lines), lines
    assert (
        f'auto fit: mesh.context=2 (the fewest devices per sequence that fit: {report.total_bytes / aot.GiB:.2f} '
        'GiB per device)' in lines
    ), lines
    assert (fitted.mesh.context, fitted.train.microbatches, fitted.model.attention_impl) == (2, 2, 'xla')
    assert report.mesh == {'data': 1, 'fsdp': 2, 'context': 2, 'tensor': 1}
    assert report.total_bytes <= aot.FIT_MARGIN * hbm


@pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason='libtpu is not installed (pip install "jax[tpu]"), so no TPU topology can be described',
)
def test_hosts_whose_chips_split_the_same_sequences_read_the_same_rows():
    """On a v5p:2x2x2 (two hosts of 4 chips), mesh.context=4 keeps each host's own share of every
    batch's rows; context 8 splits each sequence over both hosts, which then read the same rows.
    A mesh that gives hosts overlapping, unequal rows is refused."""
    pod, _ = aot.tpu_devices('v5p:2x2x2')
    shares = {
        context: [sharding.row_share(sharding.make_mesh(MeshConfig(context=context), pod), host) for host in (0, 1)]
        for context in (4, 8)
    }
    assert shares == {4: [(0, 2), (1, 2)], 8: [(0, 1), (0, 1)]}
    by_process = sorted(pod, key=lambda d: d.process_index)  # 4 rows of 2: rows 1 and 3 on both hosts
    tangled = np.asarray([by_process[i] for i in (0, 1, 2, 4, 5, 6, 3, 7)]).reshape(1, 4, 2, 1)
    with pytest.raises(
        ConfigError,
        match=r'cannot feed its hosts: processes must hold the same or disjoint equal '
        r'shares of the batch rows \(process 0: rows \[0, 1, 3\], process 1: '
        r'rows \[1, 2, 3\]\)',
    ):
        sharding.row_share(Mesh(tangled, sharding.MESH_AXES))


def test_the_cudnn_call_means_what_the_xla_path_computes(monkeypatch):
    """The cudnn branch's call, with jax's XLA implementation underneath (cuDNN needs a GPU): the
    layouts, GQA and the causal mask agree with vrl's path, so on a GPU only the kernel changes."""
    monkeypatch.setattr(attention, 'DOT_PRODUCT_ATTENTION', 'xla')
    keys = jax.random.split(jax.random.key(6), 3)
    q = jax.random.normal(keys[0], (2, 64, 4, 16))
    k, v = (jax.random.normal(key, (2, 64, 2, 16)) for key in keys[1:])
    want = attention.attention('xla', q, k, v, attention.Causal(None), causal_chunks=2)
    got = attention.attention('cudnn', q, k, v, attention.Causal(None), causal_chunks=2)
    assert rel_err(got, want) < 1e-5
    # a local layer: cuDNN's sliding window (local_window_size) is vrl's window
    local = attention.Causal(None, window=10, local=True)
    want_local = attention.attention('xla', q, k, v, local, causal_chunks=2)
    assert rel_err(attention.attention('cudnn', q, k, v, local, causal_chunks=2), want_local) < 1e-5
    assert rel_err(want_local, want) > 0.1


@pytest.mark.skipif(
    jax.default_backend() != 'gpu',
    reason='cuDNN needs an NVIDIA GPU: JAX_PLATFORMS=cuda python -m pytest tests/test_attention.py -k gpu',
)
def test_cudnn_on_a_gpu_attends_with_a_parts_chunks_as_the_xla_path_does():
    """On a GPU, the cuDNN calls the context-parallel path makes for one device's part: part 1 of 4
    of a striped sequence, 4 query chunks each over the keys up to its last query, the mask as a
    (1, 1, rows, keys) bias. Outputs and q, k, v gradients (bfloat16, GQA) match vrl's XLA path
    on the same inputs. (Splitting over several GPUs changes nothing in these calls.)"""
    parts, part, chunks = 4, 1, 4
    B, L, H, K, Dh = 2, 2048, 8, 2, 64
    P = L // parts
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (B, P, H, Dh), jnp.bfloat16)
    k, v = (jax.random.normal(key, (B, L, K, Dh), jnp.bfloat16) for key in keys[1:3])
    weights = jax.random.normal(keys[3], (B, P, H, Dh))
    query_position = parts * jnp.arange(P) + part  # balanced_order's, keys in sequence order
    mask = jnp.broadcast_to(attention._seen(query_position[:, None], jnp.arange(L)[None, :], 0, False), (B, P, L))

    def loss(q, k, v, attend):
        return jnp.sum(attention._xla(q, k, v, mask, chunks, attend).astype(jnp.float32) * weights)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (want, want_grads), (got, got_grads) = run(q, k, v, ops.attention), run(q, k, v, attention._cudnn_attention)
    assert 'cudnn' in run.lower(q, k, v, attention._cudnn_attention).compile().as_text().lower()
    assert abs(float(got - want)) / abs(float(want)) < 2e-2
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < 3e-2
