"""The study runner: fits, data saved and the critical step on results with known answers; the size
ladder and the plan; a real tiny study that reuses its runs; and bad input refused with nothing
overwritten."""

import dataclasses
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from etils import epath

from tests.conftest import ROOT
from tests.runs import cli_args, saved_steps, tiny_config
from vrl.data.config import DataConfig
from vrl.experiments import curves, grid, ledger, scaling, study, study_report
from vrl.experiments.grid import GridError
from vrl.model.config import ModelConfig
from vrl.train.config import Config, OptimizerConfig, TrainConfig

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


# --- the statistics, on numbers with known answers ---


def test_power_law_fit_recovers_exponent_and_offset():
    n = np.array([1e6, 2e6, 4e6, 8e6])
    law = scaling.fit_power_law(n, 7.0 * n**-0.08)
    assert law.a == pytest.approx(7.0, rel=1e-9) and law.alpha == pytest.approx(0.08, rel=1e-9)
    assert max(map(abs, law.residuals)) < 1e-12
    noisy = 7.0 * n**-0.08 * np.exp(np.array([1e-3, -1e-3, 1e-3, -1e-3]))
    law = scaling.fit_power_law(n, noisy)
    assert law.alpha == pytest.approx(0.08, abs=2e-3)
    np.testing.assert_allclose(law.residuals, noisy - law.loss(n), rtol=1e-12)
    assert law.params_for(float(law.loss(3e6))) == pytest.approx(3e6, rel=1e-9)


def test_params_saved_is_one_minus_the_inverse_of_the_effective_size_factor():
    """A variant that behaves like vanilla with k times its parameters saves 1 - 1/k of them at equal loss."""
    n = np.array([1e6, 2e6, 4e6])
    for k in (1.15, 1.0, 0.8):
        baseline = scaling.fit_power_law(n, 5.0 * n**-0.1)
        variant = scaling.fit_power_law(n, 5.0 * (k * n) ** -0.1)
        for at in n:
            assert scaling.params_saved(variant, baseline, at) == pytest.approx(1 - 1 / k, abs=1e-9)


def test_bootstrap_interval_holds_the_estimate_and_widens_with_the_seed_spread():
    n = [1e6, 2e6, 4e6]
    base = [[5.0 * x**-0.1] * 2 for x in n]
    variant = [[5.0 * (1.15 * x) ** -0.1] * 2 for x in n]
    low, high = scaling.bootstrap_params_saved(variant, base, n, n, 2e6)
    assert low == pytest.approx(1 - 1 / 1.15, abs=1e-9) and high == pytest.approx(low, abs=1e-9)
    noisy = [[v - 0.01, v + 0.01] for v, _ in variant]
    low, high = scaling.bootstrap_params_saved(noisy, base, n, n, 2e6)
    assert low < 1 - 1 / 1.15 < high and high - low > 0.05


@pytest.mark.parametrize(
    'n, loss, message',
    [
        ([1e6, 1e6], [3.0, 3.1], 'two or more sizes'),
        ([1e6, 2e6], [3.0, 3.1], 'does not fall with size'),
    ],
)
def test_fit_refuses_what_it_cannot_fit(n, loss, message):
    with pytest.raises(scaling.FitError, match=message):
        scaling.fit_power_law(n, loss)


def test_step_to_reach_interpolates_between_evals():
    curve = {50: 5.0, 100: 4.0, 150: 3.5, 200: 3.0}
    assert curves.step_to_reach(curve, 3.75) == pytest.approx(125.0)
    assert curves.step_to_reach(curve, 4.0) == 100.0
    assert curves.step_to_reach(curve, 6.0) == 50.0  # already there at the first eval
    assert curves.step_to_reach(curve, 2.9) is None  # never


def test_critical_step_on_curves_with_known_crossings():
    steps = range(1, 201)
    vanilla = {s: 4.0 for s in steps}
    overtaken = {s: 3.9 if s <= 120 else 4.1 for s in steps}  # leads until 120, then behind for good
    crossing = curves.critical_step(overtaken, vanilla, 1)
    assert crossing == curves.Crossing(121, True) and crossing.describe() == 'step 121'
    assert curves.critical_step(overtaken, vanilla, 10).step == 126  # the 10-step average crosses 0 later
    flickering = {s: 3.9 if s <= 120 or s == 150 else 4.1 for s in steps}  # back ahead once at 150
    assert curves.critical_step(flickering, vanilla, 1).step == 151
    ahead = {s: 3.9 for s in steps}
    assert curves.critical_step(ahead, vanilla, 1) == curves.Crossing(None, True)
    assert curves.critical_step(ahead, vanilla, 1).describe() == 'not within the budget'
    behind = {s: 4.1 for s in steps}
    assert curves.critical_step(behind, vanilla, 1) == curves.Crossing(1, False)


def test_smoothing_window_is_the_papers_100_steps_at_most_a_tenth_of_the_run():
    assert [curves.smoothing_window(s) for s in (4, 20, 400, 5000)] == [1, 2, 40, 100]


def _result(variant, size, n, lr, seed, loss, curve, tokens_per_step=100, seq_len=10):
    return {
        'variant': variant,
        'coordinates': {'size': size},
        'seq_len': seq_len,
        'peak_lr': lr,
        'seed': seed,
        'eval_loss': loss,
        'non_embedding_params': n,
        'step': max(curve),
        'tokens_per_step': tokens_per_step,
        'eval_curve': {str(k): v for k, v in curve.items()},
        'train_loss': {str(k): v for k, v in curve.items()},
        'diagnostics': {
            str(k): {'first_token_attention': [0.5, v / 10, 0.3], 'entropy': [1.0, v, 2.0]} for k, v in curve.items()
        },
    }


def test_summary_of_a_synthetic_study(tmp_path):
    """Vanilla's loss 5 N^-0.1 at its best LR (1e-3); the variant behaves like vanilla with 1.25 N at
    its best LR (3e-3, at the edge); its eval curve reaches vanilla's final loss at 80% of the steps."""
    sizes, n = ['s', 'm', 'l'], [1e6, 2e6, 4e6]
    axes = study.Axes(['vanilla', 'resformer'], sizes, [1e-3, 2e-3, 3e-3], [0, 1], [10])
    results = []
    for size, count in zip(sizes, n):
        for seed in (0, 1):
            final = 5.0 * count**-0.1
            for lr, worse in ((1e-3, 0.0), (2e-3, 0.1), (3e-3, 0.2)):
                results.append(
                    _result(
                        'vanilla',
                        size,
                        count,
                        lr,
                        seed,
                        final + worse,
                        {s: final + worse + (100 - s) / 100 for s in (20, 40, 60, 80, 100)},
                    )
                )
            final_v = 5.0 * (1.25 * count) ** -0.1
            reach = (final - final_v) * 100  # its curve final_v + (100 - s) / 100 is at `final` at step 100 - reach
            for lr, worse in ((1e-3, 0.2), (2e-3, 0.1), (3e-3, 0.0)):
                results.append(
                    _result(
                        'resformer',
                        size,
                        count * 0.95,
                        lr,
                        seed,
                        final_v + worse,
                        {s: final_v + worse + (100 - s) / 100 for s in (20, 40, 60, 80, 100)},
                    )
                )
    summary = study_report.summarize(study_report.Points(results, axes), 10)
    best = {(r['variant'], r['size']): r for r in summary['best_lr']}
    assert best[('vanilla', 'm')]['lr'] == 1e-3 and best[('vanilla', 'm')]['at_edge']
    assert best[('resformer', 'm')]['lr'] == 3e-3 and best[('resformer', 'm')]['at_edge']
    assert not np.isnan(best[('vanilla', 'm')]['losses'][1e-3][1])
    fit = summary['fits']['variants']
    assert fit['vanilla']['alpha'] == pytest.approx(0.1) and fit['resformer']['alpha'] == pytest.approx(0.1)
    for row in summary['fits']['params_saved']['resformer']:
        # its loss at its own N_v = 0.95 N is vanilla's at 1.25 N: k = 1.25 / 0.95 times its parameters
        assert row['saved'] == pytest.approx(1 - 0.95 / 1.25, abs=1e-9)
        assert row['interval'][0] == pytest.approx(row['saved'], abs=1e-9)
    # at N_vanilla = 1e6 the variant would need 0.76e6, below its smallest size (0.95e6): extrapolated
    assert [row['extrapolated'] for row in summary['fits']['params_saved']['resformer']] == [True, False, False]
    for size, count in zip(sizes, n):
        reach = (5.0 * count**-0.1 - 5.0 * (1.25 * count) ** -0.1) * 100
        data = summary['data_saved'][size]['resformer']
        assert (
            data['saved'] == pytest.approx(reach / 100, rel=1e-6)
            and data['saved_per_seed'] == [pytest.approx(reach / 100, rel=1e-6)] * 2
        )
        assert data['tokens'] == pytest.approx((100 - reach) * 100, rel=1e-6)
    critical = summary['critical_steps']['m']['10']['resformer']
    assert critical['step'] is None and critical['variant_led']  # ahead throughout
    written = {p.name for p in study_report.write_plots(study_report.Points(results, axes), summary, tmp_path)}
    assert {
        f'diagnostics_{name}_{size}.png' for name in ('first_token_attention', 'entropy') for size in sizes
    } <= written


def test_sizes_fit_on_a_downstream_score_as_its_error(tmp_path):
    """--fit_metric=toy/acc: vanilla's error 1 - acc is 0.5 N^-0.2, the variant's is vanilla's at 1.25 N
    from 0.95 N parameters; the loss (which picks the LR) says nothing of it."""
    sizes, n = ['s', 'm', 'l'], [1e6, 2e6, 4e6]
    axes = study.Axes(['vanilla', 'resformer'], sizes, [1e-3], [0, 1], [10], fit_metric='toy/acc')
    results = []
    for size, count in zip(sizes, n):
        for seed in (0, 1):
            for variant, params, error in (
                ('vanilla', count, 0.5 * count**-0.2),
                ('resformer', 0.95 * count, 0.5 * (1.25 * count) ** -0.2),
            ):
                run = _result(variant, size, params, 1e-3, seed, 3.0, {50: 3.5, 100: 3.0})
                curve = {'50': 0.5 - error / 2, '100': 1.0 - error * (0.95 + 0.1 * seed)}  # seeds' mean: 1 - error
                run |= {'downstream': {'toy': {'acc': curve['100']}}, 'downstream_curves': {'toy/acc': curve}}
                results.append(run)
    summary = study_report.summarize(study_report.Points(results, axes), 10)
    fit = summary['fits']
    assert fit['of'] == '1 - toy/acc'
    assert fit['variants']['vanilla']['alpha'] == pytest.approx(0.2)
    for row in fit['params_saved']['resformer']:
        assert row['saved'] == pytest.approx(1 - 0.95 / 1.25)
    points = study_report.Points(results, axes)
    figures = study_report.write_plots(points, summary, tmp_path)
    assert {f'downstream_toy_acc_{size}.png' for size in sizes} <= {p.name for p in figures}
    report = study_report.report(points, summary, {size: BASE.model for size in sizes}, 'intro.', figures)
    assert '## 1 - toy/acc vs parameters' in report and 'equal 1 - toy/acc against vanilla' in report
    error = 0.5 * 1.25e6**-0.2
    assert f'| s | resformer | {curves.plus_minus(1 - error, 0.1 * error / np.sqrt(2))} |' in report
    with pytest.raises(
        GridError,
        match=r"--fit_metric=toy/acc_norm: run vanilla \{'size': 's'\} seed 0 has no such "
        r'final score \(it has: toy/acc\)',
    ):
        study_report.summarize(study_report.Points(results, dataclasses.replace(axes, fit_metric='toy/acc_norm')), 10)


# --- sizes and the plan ---

BASE = Config(
    model=ModelConfig(
        vocab_size=512,
        vocab_pad_multiple=64,
        n_layers=8,
        d_model=128,
        n_heads=4,
        n_kv_heads=4,
        head_dim=32,
        d_ff=384,
        compute_dtype='float32',
    ),
    data=DataConfig(seq_len=128, batch_size=16),
    optimizer=OptimizerConfig(peak_lr=3e-3, final_lr=3e-4, warmup_steps=30, decay_steps=400),
    train=TrainConfig(steps=400),
)


def test_sizes_scale_width_and_depth_from_the_base():
    d96 = study.sized('d96', BASE.model)
    assert (d96.d_model, d96.n_heads, d96.n_kv_heads, d96.d_ff, d96.n_layers) == (96, 3, 3, 288, 8)
    assert study.sized('l12', BASE.model).n_layers == 12 and study.sized('l12', BASE.model).d_model == 128
    both = study.sized('d64l4', BASE.model)
    assert (both.d_model, both.n_heads, both.n_layers) == (64, 2, 4)
    assert study.sized('base', BASE.model) == BASE.model
    gqa = dataclasses.replace(BASE.model, n_kv_heads=2)
    assert study.sized('d256', gqa).n_kv_heads == 4  # the base's 2 query heads per kv head


@pytest.mark.parametrize(
    'name, message',
    [
        ('x12', "'x12' is not a size; allowed 'base', d<width>, l<layers>"),
        ('', "'' is not a size"),
        ('d100', 'a multiple of head_dim'),
        ('d16', 'a multiple of head_dim'),
    ],
)
def test_bad_sizes_are_named(name, message):
    with pytest.raises(grid.GridError, match=message):
        study.sized(name, BASE.model)


def test_plan_keeps_tokens_per_step_and_scales_the_budget():
    axes = study.Axes(['vanilla', 'svformer'], ['d64', 'd128'], [1e-3, 3e-3], [0, 1], [64, 128], budget='params')
    runs = study.plan(BASE, axes)
    assert len(runs) == 2 * 2 * 2 * 2 * 2 and len({r.name for r in runs}) == len(runs)
    for run in runs:
        cfg = run.config
        assert cfg.data.batch_size * cfg.data.seq_len == 16 * 128
        assert cfg.optimizer.final_lr == pytest.approx(cfg.optimizer.peak_lr / 10)
        assert cfg.train.sample_tokens == 0 and cfg.train.log_every == 1
    by_name = {r.name: r.config for r in runs}
    small, large = by_name['vanilla-d64-lr0.001-L64-s0'], by_name['vanilla-d128-lr0.001-L64-s0']
    assert large.train.steps == 400 and large.optimizer.decay_steps == 400
    from vrl.model import accounting

    ratio = accounting.non_embedding_params(small.model) / accounting.non_embedding_params(large.model)
    assert small.train.steps == round(400 * ratio) and small.optimizer.decay_steps == small.train.steps
    assert by_name['svformer-d64-lr0.001-L64-s0'].train.steps == small.train.steps  # the same tokens per size
    fixed = study.plan(BASE, dataclasses.replace(axes, budget='steps'))
    assert {r.config.train.steps for r in fixed} == {400}


@pytest.mark.parametrize(
    'changes, message',
    [
        (dict(sizes=[]), '--sizes is empty'),
        (dict(lrs=[1e-3, -1e-3]), '--lrs: -0.001 is invalid: allowed floats > 0'),
        (dict(lrs=[0.0]), '--lrs: 0.0 is invalid'),
        (dict(seq_lens=[100]), '--seq_lens: 100 is invalid: allowed divisors'),
        (dict(seeds=[0, 0]), '--seeds=0,0: each value once'),
        (dict(variants=['vanilla', 'resformer:learned']), "unknown variant preset 'resformer:learned'"),
        (
            dict(fit_metric='hellaswag/acc'),
            r'--fit_metric=hellaswag/acc is invalid: allowed eval_loss or TASK/METRIC of a '
            r"task the runs score while training \(--config.train.downstream_tasks=''\)",
        ),
    ],
)
def test_bad_axes_are_named(changes, message):
    axes = dataclasses.replace(study.Axes(['vanilla'], ['d64'], [1e-3], [0], [128]), **changes)
    with pytest.raises(Exception, match=message):
        study.plan(BASE, axes)


# --- a real tiny study ---


def _study(small_corpus, workdir, *args, steps=4):
    config = tiny_config(small_corpus, steps=steps, checkpoint_every=steps, eval_every=2, eval_batches=1)
    return subprocess.run(
        [
            *cli_args(config, workdir, 'vrl.experiments.study'),
            '--variants=vanilla,svformer',
            '--sizes=d32,d48',
            '--seeds=0',
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=900,
    )


def _hashes(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob('*'))
        if p.is_file() and p.name != '.lock'
    }


class Studied(NamedTuple):
    workdir: Path
    first_runs: dict[str, list[int]]  # run name -> saved steps after the first invocation
    listed: subprocess.CompletedProcess  # --list with a second LR
    again: subprocess.CompletedProcess  # the second LR trained


@pytest.fixture(scope='module')
def studied(small_corpus, tmp_path_factory) -> Studied:
    """A 2 x 2 x 1 study, then the same with a second LR: 8 tiny runs in all."""
    workdir = tmp_path_factory.mktemp('study')
    first = _study(small_corpus, workdir, '--lrs=1e-3')
    assert first.returncode == 0, first.stderr[-3000:]
    first_runs = {p.parent.name: saved_steps(p.parent) for p in (workdir / 'runs').glob('*/result.json')}
    listed = _study(small_corpus, workdir, '--lrs=1e-3,3e-3', '--list')
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert len(list((workdir / 'runs').iterdir())) == 4  # --list trained nothing
    again = _study(small_corpus, workdir, '--lrs=1e-3,3e-3')
    assert again.returncode == 0, again.stderr[-3000:]
    return Studied(workdir, first_runs, listed, again)


def test_study_writes_report_results_and_plots(studied):
    results = json.loads((studied.workdir / 'results.json').read_text())
    assert len(results['runs']) == 2 * 2 * 2
    assert {(r['variant'], r['coordinates']['size'], r['peak_lr']) for r in results['runs']} == {
        (v, s, lr) for v in ('vanilla', 'svformer') for s in ('d32', 'd48') for lr in (1e-3, 3e-3)
    }
    assert set(results['fits']['variants']) == {'vanilla', 'svformer'}
    assert set(results['data_saved']) == {'d32', 'd48'} and set(results['critical_steps']) == {'d32', 'd48'}
    report = (studied.workdir / 'study.md').read_text()
    for section in ('## Learning rate', '## Against vanilla', '## Loss vs parameters', '## Data saved'):
        assert section in report
    assert '## The critical step' in report
    # each size's difference from vanilla, judged against the spread: one seed here, so no finding
    for size in ('d32', 'd48'):
        assert re.search(
            rf'^\| {size} \| \d+ \| svformer \| [+-]\d\.\d{{4}} \| no spread known \(1 seed\): not a finding \|$',
            report,
            re.M,
        ), report
    assert report.count('at the edge of the sweep') == sum(r['at_edge'] for r in results['best_lr'])
    for name in (
        'loss_vs_params',
        'loss_vs_lr',
        'tokens_to_target_d32',
        'tokens_to_target_d48',
        'relative_train_loss_d32',
        'relative_train_loss_d48',
    ):
        assert (studied.workdir / f'{name}.png').read_bytes()[:4] == b'\x89PNG' and f'({name}.png)' in report


def test_one_more_lr_trains_only_the_new_runs(studied):
    assert len(studied.first_runs) == 4
    statuses = [line.split()[1] for line in studied.listed.stdout.splitlines()[1:-1]]
    assert statuses.count('recorded') == 4 and statuses.count('new') == 4  # the first 4 in the ledger
    assert 'vanilla-d48-lr0.003-L64-s0' in studied.listed.stdout and '8 runs' in studied.listed.stdout
    after = {p.parent.name for p in (studied.workdir / 'runs').glob('*/result.json')}
    assert after - set(studied.first_runs) == {
        f'{v}-{s}-lr0.003-L64-s0' for v in ('vanilla', 'svformer') for s in ('d32', 'd48')
    }
    assert all(saved_steps(studied.workdir / 'runs' / name) == steps for name, steps in studied.first_runs.items())
    assert studied.again.stdout.count('finished before, reused') == 4


def test_the_study_is_remade_from_its_ledger_alone(studied, small_corpus, tmp_path):
    """results.jsonl copied where no workdir is: --report_only writes the same study.md and summary, and
    --list counts every run as recorded."""
    import shutil

    alone = tmp_path / 'alone'
    alone.mkdir()
    shutil.copy(studied.workdir / 'results.jsonl', alone / 'results.jsonl')
    listed = _study(small_corpus, alone, '--lrs=1e-3,3e-3', '--list')
    assert [line.split()[1] for line in listed.stdout.splitlines()[1:-1]] == ['recorded'] * 8, listed.stdout
    remade = _study(small_corpus, alone, '--lrs=1e-3,3e-3', '--report_only')
    assert remade.returncode == 0, remade.stderr[-3000:]
    assert not (alone / 'runs').exists()
    assert (alone / 'study.md').read_text() == (studied.workdir / 'study.md').read_text()
    ours, theirs = (json.loads((d / 'results.json').read_text()) for d in (alone, studied.workdir))
    assert {k: v for k, v in ours.items() if k != 'runs'} == {k: v for k, v in theirs.items() if k != 'runs'}


def test_another_base_config_is_refused_and_nothing_is_overwritten(studied, small_corpus):
    before = _hashes(studied.workdir)
    refused = _study(small_corpus, studied.workdir, '--lrs=1e-3', steps=5)
    assert refused.returncode != 0 and 'Traceback' not in refused.stderr
    assert 'holds a study of another config: train.steps was 4 there and is 5 now' in refused.stderr
    assert _hashes(studied.workdir) == before


def test_a_record_from_before_a_field_existed_reads_it_as_its_default(tmp_path):
    """A study directory written before vrl had a config field is the same study while the field keeps
    its default, and another one once it does not."""
    directory = grid.GridDirectory(epath.Path(tmp_path), 'study.json', 'study')
    record = {'base_config': dataclasses.asdict(Config())}
    del record['base_config']['model']['hyper_streams']
    (tmp_path / 'study.json').write_text(json.dumps(record))
    directory.check_same_base(Config())
    wider = Config(model=ModelConfig(residual='mhc', hyper_streams=2))
    with pytest.raises(GridError, match="model.residual was 'plain' there and is 'mhc' now"):
        directory.check_same_base(wider)


def test_a_record_from_before_model_residual_is_the_same_study(tmp_path):
    """A study directory whose base config names each residual method's switch (before model.residual) is
    the same study as today's config of that method, and another one than a different method's."""
    directory = grid.GridDirectory(epath.Path(tmp_path), 'study.json', 'study')
    model = {k: v for k, v in dataclasses.asdict(ModelConfig()).items() if k not in ('residual', 'mudd_ways')}
    model.update(denseformer=False, mudd='vr', hyper_connections='', attn_residuals='', attn_residual_blocks=8)
    record = {'base_config': {**dataclasses.asdict(Config()), 'model': model}}
    (tmp_path / 'study.json').write_text(json.dumps(record))
    directory.check_same_base(Config(model=ModelConfig(residual='mudd', mudd_ways='vr')))
    with pytest.raises(GridError, match="model.mudd_ways was 'vr' there and is 'qkvr' now"):
        directory.check_same_base(Config(model=ModelConfig(residual='mudd')))


def test_a_ladder_of_one_size_reports_without_a_fit(small_corpus, tmp_path):
    config = tiny_config(small_corpus, steps=2, checkpoint_every=2, eval_every=1, eval_batches=1)
    result = subprocess.run(
        [*cli_args(config, tmp_path, 'vrl.experiments.study'), '--variants=vanilla', '--sizes=base'],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / 'study.md').read_text()
    assert 'no fit: a fit of loss against parameters needs two or more sizes; got 1' in report
    assert '## Data saved' in report and (tmp_path / 'loss_vs_lr.png').exists()


@pytest.mark.parametrize(
    'args, message',
    [
        (['--sizes=d32,x9'], "'x9' is not a size"),
        (['--lrs=1e-3,-1'], '--lrs: -1.0 is invalid: allowed floats > 0'),
        (['--lrs=fast'], '--lrs=fast is invalid'),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(small_corpus, tmp_path, args, message):
    config = tiny_config(small_corpus)
    result = subprocess.run(
        [*cli_args(config, tmp_path / 'new', 'vrl.experiments.study'), *args],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=300,
    )
    assert result.returncode != 0 and message in result.stderr and 'Traceback' not in result.stderr
    assert not (tmp_path / 'new').exists()


def test_each_group_of_seeds_is_in_the_ledger_as_soon_as_it_finishes(small_corpus, tmp_path, monkeypatch):
    """Two groups of two seeds: when the second group starts training, the first group's two rows are already
    in the ledger (a grid stopped there keeps them); at the end all four are, once each."""
    base = tiny_config(small_corpus, steps=2, checkpoint_every=2, eval_every=2, eval_batches=1)
    runs = study.plan(base, study.Axes(['vanilla', 'svformer'], ['d32'], [1e-3], [0, 1], [base.data.seq_len]))
    workdir = epath.Path(tmp_path)
    held = ledger.Ledger(workdir, base)
    real_train, seen = grid._train, []

    def train_and_look(members, *args):
        seen.append(sorted(row['name'] for row in held.rows().values()))  # the ledger as this group starts
        return real_train(members, *args)

    monkeypatch.setattr(grid, '_train', train_and_look)
    grid.train_all(runs, workdir, 0, held=held)
    assert seen == [[], sorted(run.name for run in runs[:2])]
    assert len(held.rows()) == 4 and len((workdir / 'results.jsonl').read_text().splitlines()) == 4
