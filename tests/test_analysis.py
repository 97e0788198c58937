"""Attention-concentration analysis: known answers, the model's statistics against the float64 NumPy
reference's attention maps, and `python -m vrl.experiments.analyze` on real trained checkpoints."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import numpy_reference
from tests.conftest import ROOT
from tests.helpers import (
    ATTN_RES_VARIANTS,
    HYPER_VARIANTS,
    NAMED_VARIANTS,
    random_tokens,
    randomize,
    rel_err,
    small_model_config,
    tensorboard_scalars,
)
from tests.runs import SHARED_RUN_STEPS
from vrl.model import layer_stats
from vrl.model.decoder import Decoder

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


STATISTICS = layer_stats.LayerStats._fields
UNGATED = [name for name in STATISTICS if name != 'value_gate']  # what a model without value embeddings reports


def test_entropy_of_uniform_and_of_one_key():
    n = 7
    uniform = jnp.full((2, n, n), 1 / n)
    np.testing.assert_allclose(layer_stats.attention_entropy(uniform), [math.log(n)] * 2, rtol=1e-6)
    one_key = jnp.zeros((2, n, n)).at[:, :, 3].set(1.0)
    np.testing.assert_allclose(layer_stats.attention_entropy(one_key), [0.0, 0.0], atol=1e-7)
    assert np.all(np.asarray(layer_stats.first_token_attention(one_key)) == 0)
    np.testing.assert_allclose(layer_stats.first_token_attention(uniform), [1 / n] * 2, rtol=1e-6)


def test_similarity_of_identical_and_of_orthogonal_tokens():
    same = jnp.broadcast_to(jax.random.normal(jax.random.key(0), (1, 1, 16)), (1, 5, 16))
    np.testing.assert_allclose(layer_stats.token_similarity(same), [1.0], rtol=1e-6)
    orthogonal = (3.0 * jnp.eye(16)[:5])[None]  # 5 tokens along different axes
    np.testing.assert_allclose(layer_stats.token_similarity(orthogonal), [0.0], atol=1e-7)


def test_first_and_rest_norms():
    x = np.random.default_rng(4).normal(size=(2, 5, 3, 4))
    first, rest = layer_stats.first_and_rest_norms(jnp.asarray(x, jnp.float32))
    norms = [[np.sqrt(sum(v * v for v in x[b, t].ravel())) for t in range(5)] for b in range(2)]
    np.testing.assert_allclose(first, [norms[0][0], norms[1][0]], rtol=1e-6)
    np.testing.assert_allclose(rest, [np.mean(norms[0][1:]), np.mean(norms[1][1:])], rtol=1e-6)


@pytest.mark.parametrize(
    'variant',
    [
        'vanilla',
        'resformer-learnable_plus',
        'svformer-cla2',
        'all-baselines',
        'resformer-mudd-vr',
        'mhc',
        'attnres-full',
        'attnres-block1-resformer',
    ],
)
def test_layer_stats_match_the_numpy_reference(variant):
    cfg = small_model_config(**(NAMED_VARIANTS | HYPER_VARIANTS | ATTN_RES_VARIANTS)[variant])
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    randomize(model, 1)
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tokens = np.asarray(random_tokens(2, B=2, L=10))
    stats = model.layer_stats(jnp.asarray(tokens))
    for b in range(2):
        trace = []
        numpy_reference.forward(cfg, params, tokens[b], trace)
        expected = {name: [] for name in STATISTICS}
        expected['similarity'].append(_np_similarity(params['embed'][tokens[b]]))
        for att_HxLxL, v_LxKxDh, h_LxD, value_gate in trace:
            expected['value_gate'].append(value_gate)
            importance = att_HxLxL.mean(0).sum(0) / att_HxLxL.mean(0).sum()
            expected['entropy'].append(-np.sum(importance * np.log(importance)))
            expected['first_token_attention'].append(att_HxLxL.mean(0)[:, 0].mean())
            v_norms, h_norms = np.linalg.norm(v_LxKxDh.reshape(10, -1), axis=-1), np.linalg.norm(h_LxD, axis=-1)
            expected['value_norm_first'].append(v_norms[0])
            expected['value_norm_rest'].append(v_norms[1:].mean())
            expected['hidden_norm_first'].append(h_norms[0])
            expected['hidden_norm_rest'].append(h_norms[1:].mean())
            expected['similarity'].append(_np_similarity(h_LxD))
        for name in STATISTICS:
            got = np.asarray(getattr(stats, name))[:, b]
            assert got.shape == (cfg.n_layers + (name == 'similarity'),), name
            assert _close(got, expected[name], 1e-4), name


def test_statistics_are_sown_per_layer_and_leave_nothing_in_the_model():
    """Recorded inside a jit that closes over the model (its modules of an outer trace) as eagerly;
    neither that nor a plain forward leaves a sown value in the model."""
    model = Decoder(small_model_config(**NAMED_VARIANTS['resformer-learnable_plus']), rngs=nnx.Rngs(0))
    randomize(model, 4)
    tokens = random_tokens(5, B=2, L=10)
    eager = model.layer_stats(tokens)
    closed_over = jax.jit(lambda t: model.layer_stats(t))(tokens)
    for name in STATISTICS:
        assert _close(getattr(closed_over, name), getattr(eager, name), 1e-5), name
    model(tokens)
    assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))


def _close(got, expected, tolerance: float) -> bool:
    """NaN (or None: a layer without the statistic) in the same places, the rest within `tolerance`."""
    got, expected = np.asarray(got, float), np.asarray(expected, float)
    real = ~np.isnan(expected)
    return np.array_equal(np.isnan(got), ~real) and (not real.any() or rel_err(got[real], expected[real]) < tolerance)


def _np_similarity(h_LxD: np.ndarray) -> float:
    unit = h_LxD / np.linalg.norm(h_LxD, axis=-1, keepdims=True)
    cos = unit @ unit.T
    L = len(h_LxD)
    return float((cos.sum() - np.trace(cos)) / (L * (L - 1)))


@pytest.fixture(scope='module')
def two_runs(shared_runs):
    """The session's trained vanilla and ResFormer runs (3 layers each), in one folder."""
    folder = shared_runs('vanilla').parent
    assert shared_runs('resformer').parent == folder
    return folder


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, '-m', 'vrl.experiments.analyze', *args],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=600,
    )


def test_analyze_command_writes_json_and_plots(two_runs, tmp_path):
    out = tmp_path / 'out'
    result = _analyze(
        f'--workdir={two_runs / "vanilla"}',
        f'--workdir={two_runs / "resformer"}',
        f'--out={out}',
        '--sequences=6',
        '--seq_len=32',
        '--batch_size=4',
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for run, variant in (('vanilla', 'vanilla + MQA'), ('resformer', 'resformer (learnable) + MQA')):
        record = json.loads((out / run / 'analysis.json').read_text())
        assert set(record) == set(UNGATED) | {'variant', 'step', 'sequences', 'seq_len'}
        assert (record['variant'], record['step'], record['sequences'], record['seq_len']) == (
            variant,
            SHARED_RUN_STEPS,
            6,
            32,
        )
        for name in UNGATED:
            assert len(record[name]) == 3 + (name == 'similarity') and all(np.isfinite(record[name])), name
        assert all(0 <= e <= math.log(32) + 1e-6 for e in record['entropy'])
        assert all(0 < m <= 1 for m in record['first_token_attention'])
    for name in ('entropy', 'similarity', 'first_token_attention', 'value_norms', 'hidden_norms'):
        assert (out / f'{name}.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert 'entropy per layer' in result.stdout


@pytest.mark.parametrize(
    'args, message',
    [
        (['--workdir={empty}'], 'config.json not found'),
        (['--workdir={config_only}'], 'no checkpoint in'),
        (['--workdir={vanilla}', '--seq_len=65'], '--seq_len=65 is invalid: allowed 2..64'),
        (['--workdir={vanilla}', '--sequences=0'], '--sequences=0 is invalid'),
        (['--workdir={vanilla}', '--sequences=100000'], 'fewer than --sequences=100000'),
    ],
)
def test_analyze_bad_input_is_one_clear_line(two_runs, tmp_path, args, message):
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'config_only').mkdir()
    (tmp_path / 'config_only' / 'config.json').write_text((two_runs / 'vanilla' / 'config.json').read_text())
    places = {'empty': tmp_path / 'empty', 'config_only': tmp_path / 'config_only', 'vanilla': two_runs / 'vanilla'}
    result = _analyze(*[a.format(**places) for a in args], f'--out={tmp_path / "out"}')
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr
    assert not (tmp_path / 'out').exists()  # nothing half-written


def test_generate_and_analyze_refuse_a_config_json_that_is_not_their_checkpoints(two_runs, tmp_path):
    """config.json edited after training (another RoPE theta, the same shapes): both tools name the
    field and both values, and run nothing."""
    workdir = Path(shutil.copytree(two_runs / 'vanilla', tmp_path / 'edited'))
    record = json.loads((workdir / 'config.json').read_text())
    record['config']['model']['rope_theta'] = 500_000.0
    (workdir / 'config.json').write_text(json.dumps(record))
    message = 'trained with model.rope_theta=10000.0 but the config has model.rope_theta=500000.0'
    analyzed = _analyze(f'--workdir={workdir}', f'--out={tmp_path / "out"}')
    generated = subprocess.run(
        [sys.executable, '-m', 'vrl.tools.generate', f'--workdir={workdir}', '--prompt=ROMEO:'],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=600,
    )
    for result in (analyzed, generated):
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
        assert 'Traceback' not in result.stderr
    assert not (tmp_path / 'out').exists() and 'ROMEO:' not in generated.stdout


def test_generate_labels_its_speed_line_with_the_runs_variant(small_corpus, tmp_path):
    """vrl.tools.generate on a SkipV1Former run: the speed line names the variant as the run's start line
    does ('vanilla + SkipV1 1/2'), not the attention field alone ('vanilla')."""
    import dataclasses

    from tests.runs import tiny_config
    from vrl.model import presets
    from vrl.train import loop

    config = tiny_config(small_corpus, attention='vanilla', steps=1, checkpoint_every=1)
    config = dataclasses.replace(config, model=presets.apply('skipv1', dataclasses.replace(config.model, n_kv_heads=2)))
    loop.run(config, str(tmp_path / 'skipv1'))
    generated = subprocess.run(
        [
            sys.executable,
            '-m',
            'vrl.tools.generate',
            f'--workdir={tmp_path / "skipv1"}',
            '--prompt=ROMEO:',
            '--max_new_tokens=8',
        ],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=600,
    )
    assert generated.returncode == 0, generated.stderr[-2000:]
    speed = generated.stdout.strip().splitlines()[-1]
    assert speed.startswith(f'{config.model.variant_name}: prefill ') and 'SkipV1' in speed, speed


def test_training_logs_the_diagnostics_that_analyze_computes_on_its_checkpoint(small_corpus, tmp_path):
    """train.diagnostics_every: per layer, the statistics of vrl.experiments.analyze on the same sequences and
    parameters (to rounding), ResFormer's lambdas as the checkpoint holds them, the gates of the
    layers with value embeddings (null in the one without), in metrics.jsonl and as one TensorBoard
    chart per statistic."""
    import dataclasses

    from tests.runs import tiny_config
    from vrl.experiments import analyze
    from vrl.train import loop
    from vrl.train.rundir import checkpoint

    config = tiny_config(
        small_corpus,
        attention='resformer',
        steps=4,
        checkpoint_every=4,
        diagnostics_every=2,
        diagnostics_sequences=3,
        sample_tokens=0,
    )
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=3, value_embed_layers=(1, 3)))
    workdir = tmp_path / 'run'
    result = loop.run(config, str(workdir))
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    logged = {r['step']: r['diagnostics'] for r in records if 'diagnostics' in r}
    assert sorted(logged) == [2, 4]
    assert set(logged[4]) == set(STATISTICS) | {'lambda_1', 'lambda_2'}
    assert len(logged[4]['entropy']) == 3 and len(logged[4]['similarity']) == 4 and len(logged[4]['lambda_1']) == 2
    assert logged[2]['entropy'] != logged[4]['entropy']  # the parameters of that step, not the first ones

    analysed = analyze.analyze_run(str(workdir), 3, 0, 2)  # the same 3 sequences, in other batches
    gates = logged[4]['value_gate']
    assert gates[1] is None and all(0 < g < 2 and g != 1 for g in (gates[0], gates[2]))  # moved off the init's 1
    for name in STATISTICS:
        assert _close(logged[4][name], analysed[name], 1e-5), name
    lambdas = result.state.params['lambdas']
    np.testing.assert_allclose(logged[4]['lambda_1'], np.asarray(lambdas['v1'][...]), rtol=1e-6)
    np.testing.assert_allclose(logged[4]['lambda_2'], np.asarray(lambdas['vn'][...]), rtol=1e-6)
    assert checkpoint.latest_step(workdir) == 4

    charts = tensorboard_scalars(workdir / 'tensorboard')
    entropy = {folder: points for (folder, tag), points in charts.items() if tag == 'diagnostics/entropy'}
    assert len(entropy) == 3, list(charts)  # one line per layer in one chart
    assert len({folder for folder, tag in charts if tag == 'diagnostics/value_gate'}) == 2  # the gated layers
    assert all([step for step, _ in points] == [2, 4] for points in entropy.values())
