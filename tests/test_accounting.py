"""Counts from the config alone equal the real module's; the paper's sizes and ratios hold."""

import dataclasses
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base, modern, preset
from tests.helpers import (
    ATTN_RES_VARIANTS,
    HYPER_VARIANTS,
    NAMED_VARIANTS,
    SKIP_V1_VARIANTS,
    VARIANT_IDS,
    VARIANTS,
    module_matmul_params,
    random_tokens,
    randomize,
    small_model_config,
    variant_params,
)
from vrl.core.config import ConfigError
from vrl.model import accounting
from vrl.model.decoder import Decoder
from vrl.model.residual import hyper
from vrl.train.config import from_configdict


def _real_param_count(cfg) -> int:
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    'variant',
    VARIANTS
    + [dict(attention='svformer', tie_embeddings=True), dict(attention='vanilla', kv_share=2, qk_norm=True)]
    + list(HYPER_VARIANTS.values())
    + list(ATTN_RES_VARIANTS.values()),
    ids=VARIANT_IDS + ['svformer-tied', 'cla2-qk_norm'] + list(HYPER_VARIANTS) + list(ATTN_RES_VARIANTS),
)
def test_count_from_config_equals_module(variant):
    cfg = small_model_config(**variant)
    assert accounting.account(cfg, 16).params == _real_param_count(cfg)


def _paper_config(variant: str, size: str):
    config_dict = base.get_config(f'{variant},{size}')
    config_dict.model.vocab_size = 50277
    return from_configdict(config_dict)


@pytest.mark.parametrize('size, paper_params', [('82m', 81.9e6), ('180m', 179.9e6), ('468m', 467.9e6)])
def test_paper_sizes(size, paper_params):
    vanilla = _paper_config('vanilla', size).model
    svformer = _paper_config('svformer', size).model
    resformer = _paper_config('resformer', size).model
    n_vanilla = accounting.account(vanilla, 2048).params_unpadded
    assert abs(n_vanilla / paper_params - 1) < 0.005
    assert accounting.account(vanilla, 2048).params == _real_param_count(vanilla)
    L, D, K, Dh = vanilla.n_layers, vanilla.d_model, vanilla.n_kv_heads, vanilla.head_dim
    assert accounting.account(vanilla, 2048).params - accounting.account(svformer, 2048).params == (L - 1) * D * K * Dh
    assert accounting.account(resformer, 2048).params == accounting.account(vanilla, 2048).params
    ratio = accounting.kv_cache_bytes_per_token(svformer) / accounting.kv_cache_bytes_per_token(vanilla)
    assert ratio == (L + 1) / (2 * L)


def test_svformer_82m_saves_1_84m_params():
    saved = (
        accounting.account(_paper_config('vanilla', '82m').model, 2048).params
        - accounting.account(_paper_config('svformer', '82m').model, 2048).params
    )
    assert round(saved / 1e6, 2) == 1.84


@pytest.mark.parametrize(
    'variant',
    VARIANTS
    + [dict(attention='svformer', tie_embeddings=True), HYPER_VARIANTS['mhc'], *SKIP_V1_VARIANTS.values()]
    + [ATTN_RES_VARIANTS['attnres-block1-resformer']],
    ids=VARIANT_IDS + ['svformer-tied', 'mhc', *SKIP_V1_VARIANTS, 'attnres-block1-resformer'],
)
def test_matmul_weights_are_the_modules(variant):
    """The weights FLOPs are counted for are the real module's matmul weights, by parameter path."""
    cfg = small_model_config(**variant)
    assert accounting.matmul_params(cfg) == module_matmul_params(cfg)


@pytest.mark.parametrize(
    'variant',
    ['vanilla', 'svformer', 'resformer-per_token', 'value_embeds', 'cla2', 'mudd-qkvr', 'hc', 'mhc', 'attnres-full'],
)
def test_forward_flops_agree_with_xla_cost_analysis(variant):
    """XLA's count of the compiled forward (one pass over all keys, so no causal saving; unrolled
    layers, so each is counted) is the formula's forward (a third of training_flops_per_token's
    matmul term, the attention term doubled for the full S x S) plus the elementwise work the
    formula leaves out: between 0 and 3% more. One W_V too many or too few is 2.7% here."""
    S = 128
    cfg = small_model_config(
        **(NAMED_VARIANTS | HYPER_VARIANTS | ATTN_RES_VARIANTS)[variant],
        scan_layers=False,
        attention_chunks=1,
        vocab_size=512,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        d_ff=256,
    )
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    cost = forward.lower(params, jnp.ones((1, S), jnp.int32)).compile().cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost)['flops']
    attention = 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * S
    formula = S * ((accounting.training_flops_per_token(cfg, S) - attention) / 3 + 2 * attention / 3)
    extra = S * (2 * _mudd_padding(cfg) + _sinkhorn_flops(cfg))
    assert formula + extra <= xla_flops <= 1.03 * formula + extra, (xla_flops, formula)


def _sinkhorn_flops(cfg) -> float:
    """XLA's count of mhc's Sinkhorn per token (2 L of them): elementwise work that the formula leaves out,
    like the rest, but 6% of this small shape's forward (0.17% at 82M, 0.07% at 468M)."""
    if cfg.residual != 'mhc':
        return 0
    n = cfg.hyper_streams
    cost = jax.jit(hyper.sinkhorn).lower(jnp.ones((n, n), jnp.float32)).compile().cost_analysis()
    return 2 * cfg.n_layers * (cost[0] if isinstance(cost, list) else cost)['flops']


def _mudd_padding(cfg) -> int:
    """The multiply-adds per token that the model runs beyond MUDD's own: every layer's connection at
    the widest hidden width, with every way over all L + 1 outputs."""
    if cfg.residual != 'mudd':
        return 0
    D, C, L = cfg.d_model, len(cfg.mudd_ways), cfg.n_layers
    own = [(len(cfg.mudd_after(i)) * (i + 2), cfg.mudd_hidden(i)) for i in range(L) if cfg.mudd_after(i)]
    hidden = max(h for _, h in own)
    return L * (D * hidden + hidden * C * (L + 1) + C * (L + 1) * D) - sum(D * h + h * w + w * D for w, h in own)


def test_summary_command_prints_table_and_json():
    out = subprocess.run(
        [
            sys.executable,
            '-m',
            'vrl.main',
            '--config=configs/svformer_468m.py',
            '--summary',
            '--summary_json',
            '--config.model.vocab_size=50277',
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(__import__('tests.conftest').conftest.ROOT),
    ).stdout
    record = json.loads(out.strip().splitlines()[-1])
    assert {'params', 'non_embedding_params', 'flops_per_token', 'kv_cache_bytes_per_token'} <= set(record)
    expected = accounting.account(_paper_config('svformer', '468m').model, 2048)
    assert record['params'] == expected.params
    assert 'padded to 50304' in out and 'svformer' in out
    assert '1024 sequences x 2048 tokens = 2,097,152 tokens a step' in out
    # SVFormer 468M: 24 K slots and V_1, 2,048 positions of 16 x 64 bf16-or-float32 values each
    row = 16 * 64 * (4 if 'KV cache / token (float32)' in out else 2)
    assert re.search(rf'^KV cache at seq 2048 +{25 * 2048 * row:,} B a sequence$', out, re.M), out
    assert re.search(r'step time, estimated \(\d+ cpu device\(s\)\) +[\d.e+]+ s at 40% MFU of', out), out


@pytest.mark.parametrize(
    'config, variant',
    [
        ('configs/tiny.py:attnres', 'vanilla + AttnRes full'),
        ('configs/tiny.py:attnres:block', 'vanilla + AttnRes block (4 blocks)'),
        ('configs/reproduce_cpu.py:muon,skipv1', 'vanilla + SkipV1 2/4'),
        ('configs/base.py:mudd:vr,82m', 'vanilla + MUDD-vr'),
        ('configs/modern.py:resformer,82m', 'resformer (learnable_plus) + value embeddings'),
    ],
)
def test_every_preset_is_a_config_argument(config, variant):
    """A preset named after any config file's colon is that preset's model: --summary shows it (the
    same config that vrl.main trains, --init_from targets and the tools read)."""
    out = subprocess.run(
        [sys.executable, '-m', 'vrl.main', f'--config={config}', '--summary', '--summary_json'],
        capture_output=True,
        text=True,
        cwd=str(__import__('tests.conftest').conftest.ROOT),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])['variant'].startswith(variant), out.stdout


@pytest.mark.parametrize('blocks', [0, 3])  # full, Block AttnRes
def test_the_parameters_the_accounting_calls_constant_get_no_gradient(blocks):
    """Attention Residuals' first query and its key scale weigh the embedding alone (a softmax over one
    source is 1): their gradient is exactly zero, every other depth parameter's is not, and the accounting
    counts those 2 D as constant."""
    cfg = small_model_config(residual='attnres', attn_residual_blocks=blocks)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, 7)
    tokens = random_tokens(3, vocab=cfg.vocab_size)
    graphdef, state = nnx.split(model, nnx.Param)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

    grads = nnx.to_pure_dict(jax.grad(loss)(state))
    first = grads['first']['attn_depth']
    assert not np.any(np.asarray(first['query'])) and not np.any(np.asarray(first['key_scale']))
    for name in ('mlp_depth',):
        assert np.any(np.asarray(grads['first'][name]['query'])), name
    assert np.any(np.asarray(grads['layers']['attn_depth']['query']))
    assert accounting.account(cfg, 16).constant_params == first['query'].size + first['key_scale'].size
    assert (
        accounting.account(dataclasses.replace(cfg, residual='plain', attn_residual_blocks=0), 16).constant_params == 0
    )


def test_each_variant_changes_the_count_by_its_formula():
    """Against vanilla of the same shape, by hand: what each baseline and family member adds or removes."""
    L, D, K, Dh, V = 6, 32, 2, 8, 128  # small_model_config pads vocab 97 to 128

    def params(**overrides) -> int:
        return accounting.account(small_model_config(n_layers=L, **overrides), 16).params

    vanilla = params()
    assert params(neutreno=True) == vanilla
    assert params(residual='dense') == vanilla + L * (L + 3) // 2
    assert params(kv_share=2) == vanilla - (L // 2) * 2 * D * K * Dh  # layers 2, 4, 6 lose W_K and W_V
    assert params(kv_share=3) == vanilla - 4 * 2 * D * K * Dh
    assert params(attention='svformer', kv_share=2) == vanilla - (L // 2) * D * K * Dh - (L - 1) * D * K * Dh
    assert params(attention='resformer', lambda_mode='per_token') == vanilla + (L - 1) * D * K
    assert params(value_embed_layers=(1, 2, 5)) == vanilla + 3 * (V * K * Dh + D * K)
    assert params(value_embed_layers=(1, 2, 5), value_embed_tables=(0, 1, 0)) == vanilla + 2 * V * K * Dh + 3 * D * K
    # value-embedding tables are embeddings: not in the non-embedding count, not in the matmul FLOPs
    ve = small_model_config(n_layers=L, value_embed_layers=(1,))
    base = small_model_config(n_layers=L)
    assert accounting.non_embedding_params(ve) - accounting.non_embedding_params(base) == D * K
    assert accounting.training_flops_per_token(ve, 16) - accounting.training_flops_per_token(base, 16) == 6 * D * K
    # hyper-connections, 2 L sublayers with n = 4 streams: static 2n + n^2; hc: a scale, W (D, n + 2), 2 gates;
    # mhc: a scale (n D), phi (n D, 2n + n^2), 3 gates
    assert params(residual='hc', hyper_dynamic=False) == vanilla + 2 * L * 24
    assert params(residual='hc') == vanilla + 2 * L * (24 + D + 6 * D + 2)
    assert params(residual='mhc', hyper_streams=2) == vanilla + 2 * L * (8 + 2 * D + 2 * D * 8 + 3)


@pytest.mark.parametrize('variant', variant_params())
def test_max_batch_for_cache_is_the_largest_allocated_cache_that_fits(variant):
    from vrl.model import cache as cache_lib

    cfg = small_model_config(**variant)
    context, memory = 40, 3_000_000

    def allocated(batch: int) -> int:
        shapes = jax.eval_shape(lambda: cache_lib.init_cache(cfg, batch, context))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes) if x.ndim > 1)

    batch = accounting.max_batch_for_cache(cfg, context, memory)
    assert batch > 0 and allocated(batch) <= memory < allocated(batch + 1)


def test_svformer_fits_about_2l_over_l_plus_1_times_the_batch():
    model = from_configdict(base.get_config('vanilla,82m')).model
    L = model.n_layers
    vanilla = accounting.max_batch_for_cache(model, 8192, 64 * 2**30)
    svformer = accounting.max_batch_for_cache(dataclasses.replace(model, attention='svformer'), 8192, 64 * 2**30)
    assert abs(svformer / vanilla - 2 * L / (L + 1)) < 0.01


def test_sequence_length_study_configs_keep_2m_tokens_per_step():
    for seq, want_len in (
        ('512', 512),
        ('2k', 2048),
        ('8k', 8192),
        ('32k', 32768),
        ('64k', 65536),
        ('128k', 2**17),
        ('256k', 2**18),
    ):
        config = from_configdict(base.get_config(f'svformer,82m,{seq}'))
        assert config.data.seq_len == want_len and config.data.seq_len * config.data.batch_size == 2**21
    assert from_configdict(base.get_config('svformer,82m')).data.seq_len == 2048
    with pytest.raises(ConfigError, match="sequence length '16k' is invalid"):
        base.get_config('svformer,82m,16k')


def test_a_local_layers_attention_flops_are_its_masks_pairs():
    """Windows of 5 of 12 tokens in layers 1 and 3 of 3: the attention term counts each layer's mask
    pairs less half its diagonal (seq_len / 2 per query under the plain causal mask), so it falls by
    what the windows hide."""
    S, W = 12, 5
    cfg = small_model_config(attention_window=W, global_layers=(2,))
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    pairs = [((j <= i) & ((i - j < W) | (not cfg.is_local(n)))).sum() for n in range(cfg.n_layers)]
    attention = accounting.training_flops_per_token(cfg, S) - 6 * accounting.matmul_params(cfg)
    assert attention == pytest.approx(12 * cfg.n_heads * cfg.head_dim * sum(p - S / 2 for p in pairs) / S)
    whole = dataclasses.replace(cfg, attention_window=0, global_layers=())
    assert accounting.training_flops_per_token(whole, S) - 6 * accounting.matmul_params(cfg) > 1.2 * attention


@pytest.mark.parametrize('fields', [dict(skip_v1=1), dict(attention='svformer'), dict(skip_v1=1, kv_share=3)])
def test_the_exported_cache_keeps_local_layers_whole(fields):
    """The export's and vLLM's cache per token (served_kv_cache_bytes_per_token): vrl's without windows, and
    with windows (layers 1 and 3 of 3 local) what the same model holds with every layer global, more than vrl's
    ring buffers leave per token; --summary says which."""
    cfg = small_model_config(**fields)
    windowed = dataclasses.replace(cfg, attention_window=4, global_layers=(2,))
    assert accounting.served_kv_cache_bytes_per_token(cfg) == accounting.kv_cache_bytes_per_token(cfg)
    assert accounting.served_kv_cache_bytes_per_token(windowed) == accounting.kv_cache_bytes_per_token(cfg)
    rings = cfg.kv_share == 1  # a CLA group of 3 has a global layer: its slots stay whole in vrl too
    assert (accounting.kv_cache_bytes_per_token(windowed) < accounting.kv_cache_bytes_per_token(cfg)) == rings


@pytest.mark.parametrize('size', ['82m', '468m'])
def test_the_modern_recipe_sets_its_fields_for_each_variant(size):
    """configs/modern.py: Muon + WSD, QK-norm, the final soft cap, a 512 window with every fourth layer
    global, value embeddings where the variant projects values; counted parameters are the model's."""
    for variant, tables in (
        ('vanilla', 'every other layer'),
        ('resformer', 'every other layer'),
        ('svformer', 'layer 1'),
    ):
        config = from_configdict(modern.get_config(f'{variant},{size}'))
        m = config.model
        assert (config.optimizer.name, config.optimizer.schedule, config.data.seq_len) == ('muon', 'wsd', 2048)
        assert m.qk_norm and m.final_logits_soft_cap == 15 and m.attention_window == 512
        assert m.global_layers == tuple(range(4, m.n_layers + 1, 4)) and m.global_layers[-1] == m.n_layers
        layers = tuple(range(1, m.n_layers + 1, 2)) if tables == 'every other layer' else (1,)
        assert m.value_embed_layers == layers and m.attention == variant
    assert accounting.account(m, 2048).params == _real_param_count(m)
    with pytest.raises(ConfigError, match=r"unknown variant preset 'mamba'; allowed: vanilla, "):
        modern.get_config('mamba,82m')


def test_any_preset_at_a_base_size_and_a_bad_one_named():
    """configs/preset.py: a preset's fields on base.py's shape and recipe; an unknown preset or size names
    what is allowed."""
    config = from_configdict(preset.get_config('mudd:vr_late,468m'))
    assert (config.model.residual, config.model.mudd_ways, config.model.mudd_layers) == (
        'mudd',
        'vr',
        (16, 17, 18, 19, 20, 21, 22, 23, 24),
    )
    assert config.model.d_model == from_configdict(base.get_config('vanilla,468m')).model.d_model
    with pytest.raises(ConfigError, match=r"unknown variant preset 'mud'; did you mean 'mudd'.* --list_variants"):
        preset.get_config('mud,82m')
    with pytest.raises(ConfigError, match=r"size '8m' is invalid"):
        preset.get_config('mudd,8m')


@pytest.mark.parametrize(
    'variant',
    ['vanilla', 'denseformer', 'mudd-qkvr', 'resformer-mudd-vr', 'svformer-mudd-r', 'mhc', 'neutreno-mhc-3'],
)
def test_layer_history_bytes_are_what_the_layer_scan_carries_beside_the_hidden_state(variant):
    """accounting.layer_history_bytes_per_token against the real model: the layer scan's carry, less the
    hidden state (B, T, D), per token of a traced forward."""
    cfg = small_model_config(n_layers=4, compute_dtype='bfloat16', **(NAMED_VARIANTS | HYPER_VARIANTS)[variant])
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    B, T = 2, 7
    jaxpr = jax.make_jaxpr(lambda tokens: model(tokens))(jnp.zeros((B, T), jnp.int32))
    (scan,) = _scans(jaxpr.jaxpr)
    consts, carries = scan.params['num_consts'], scan.params['num_carry']
    carry = [v.aval for v in scan.invars[consts : consts + carries]]
    beside_h = sum(a.size * a.dtype.itemsize for a in carry) - B * T * cfg.d_model * 2
    assert beside_h == B * T * accounting.layer_history_bytes_per_token(cfg)


def _scans(jaxpr) -> list:
    """The scan equations of a jaxpr, inside calls too (history_scan's custom_vjp holds one)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == 'scan':
            found.append(eqn)
            continue
        for value in eqn.params.values():
            inner = getattr(value, 'jaxpr', value)
            if hasattr(inner, 'eqns'):
                found += _scans(inner)
    return found
