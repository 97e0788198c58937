"""The comparison runner: curve helpers with known answers, a real tiny comparison that reuses
finished runs, and bad input refused before anything is written."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.runs import cli_args, saved_steps, tiny_config, wait_for, write_choice_task
from vrl.experiments import compare_report, curves
from vrl.train.config import Config

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


def test_moving_average_is_trailing_and_keeps_length():
    np.testing.assert_allclose(curves.moving_average([1, 2, 3, 4, 10], 2), [1, 1.5, 2.5, 3.5, 7])
    np.testing.assert_allclose(curves.moving_average([4, 2, 6], 100), [4, 3, 4])


def test_relative_loss_over_common_steps():
    baseline = {s: 5.0 - 0.01 * s for s in range(1, 301)}
    better = {s: v - 0.2 for s, v in baseline.items() if s % 3}  # a curve logged on fewer steps
    steps, relative = curves.relative_loss(better, baseline, 100)
    assert steps == [s for s in range(1, 301) if s % 3]
    np.testing.assert_allclose(relative, -0.2, atol=1e-12)
    crossing = {s: baseline[s] + (0.3 if s <= 150 else -0.3) for s in baseline}
    _, relative = curves.relative_loss(crossing, baseline, 100)
    assert relative[0] == pytest.approx(0.3) and relative[-1] == pytest.approx(-0.3)
    assert relative[199] == pytest.approx(-0.3 * 50 / 100 + 0.3 * 50 / 100)  # window over the crossing


def test_summary_pairs_seeds_with_vanilla():
    results = [
        dict(variant=v, seed=s, eval_loss=loss, model=v, params=1, kv_cache_bytes_per_token=2, tokens_per_sec=3.0)
        for v, s, loss in [('vanilla', 0, 3.0), ('vanilla', 1, 3.2), ('resformer', 0, 2.9), ('resformer', 1, 3.0)]
    ]
    vanilla, resformer = compare_report.summarize(results, ['vanilla', 'resformer'])
    assert vanilla['eval_loss'] == pytest.approx(3.1) and vanilla['delta_vs_vanilla'] == 0
    assert resformer['delta_vs_vanilla'] == pytest.approx(-0.15)
    assert resformer['delta_spread'] == pytest.approx(np.std([-0.1, -0.2], ddof=1))
    # |-0.15| against the larger of the seed spreads (vanilla's 0.1414) and the paired one (0.0707)
    assert resformer['judgement'] == 'exceeds the spread 0.1414 (2 seeds)' and vanilla['judgement'] == ''


def test_every_pair_of_variants_is_differenced_by_seed_with_a_t_interval():
    """Each pair's paired difference against an independent computation: the per-seed differences' mean,
    their sample deviation and Student's t interval (scipy's ppf for n - 1 degrees of freedom, by hand
    below for 2 and 3 seeds); resolved only where the interval excludes 0; --baseline pairs each with it."""
    rng = np.random.default_rng(7)
    finals = {
        v: dict(enumerate(3 + 0.1 * rng.standard_normal(3) + shift))
        for v, shift in [('vanilla', 0.0), ('resformer', -0.5), ('svformer', -0.52)]
    }
    results = [dict(variant=v, seed=s, eval_loss=loss) for v, by_seed in finals.items() for s, loss in by_seed.items()]
    pairs = compare_report.differences(results, list(finals))
    assert [(p['a'], p['b']) for p in pairs] == [
        ('resformer', 'vanilla'),
        ('svformer', 'vanilla'),
        ('svformer', 'resformer'),
    ]
    t_975 = {1: 12.706204736174707, 2: 4.302652729749464}  # two-sided 95% quantiles of Student's t
    for p in pairs:
        deltas = np.array([finals[p['a']][s] - finals[p['b']][s] for s in range(3)])
        half = t_975[2] * deltas.std(ddof=1) / np.sqrt(3)
        assert (p['mean'], p['spread'], p['seeds']) == pytest.approx((deltas.mean(), deltas.std(ddof=1), 3))
        assert (p['low'], p['high']) == pytest.approx((deltas.mean() - half, deltas.mean() + half))
        assert p['resolved'] == (not (p['low'] <= 0 <= p['high']))
    two = curves.paired_difference({0: 3.0, 1: 3.1}, {0: 3.2, 1: 3.25, 2: 9.0})  # seed 2 has no pair
    assert two.seeds == 2 and two.high - two.mean == pytest.approx(
        t_975[1] * np.std([-0.2, -0.15], ddof=1) / np.sqrt(2)
    )
    assert not two.resolved() and 'not resolved' in compare_report.shown(
        {'a': 'x', 'b': 'y', **two.__dict__, 'resolved': False}
    )
    assert '8.98 standard deviations' in curves.what_seeds_show(
        2
    ) and 'Three seeds narrow it to ± 2.48' in curves.what_seeds_show(2)
    assert 'no spread to measure' in curves.what_seeds_show(1)
    against = compare_report.differences(results, list(finals), baseline='svformer')
    assert [(p['a'], p['b']) for p in against] == [('vanilla', 'svformer'), ('resformer', 'svformer')]


def test_a_difference_within_the_spread_or_on_one_seed_is_not_a_finding():
    assert curves.judge([3.0, 3.1], [3.05, 3.1], [-0.05, 0.0]) == 'within the spread 0.0707 (2 seeds): not a finding'
    assert curves.judge([2.5, 2.6, 2.55], [3.0, 3.1, 3.0], [-0.5, -0.5, -0.45]) == 'exceeds the spread 0.0577 (3 seeds)'
    assert curves.judge([2.0], [3.0], [-1.0]) == 'no spread known (1 seed): not a finding'


def _compare_args(small_corpus, workdir, *args: str, steps: int = 4) -> list[str]:
    """Every run also scores the task `toy_curve` every 2 steps while it trains."""
    tasks = write_choice_task(Path(small_corpus[0].data_dir) / 'curve_task', name='toy_curve')
    config = tiny_config(
        small_corpus,
        steps=steps,
        checkpoint_every=steps,
        eval_every=2,
        eval_batches=1,
        diagnostics_every=2,
        diagnostics_sequences=2,
        downstream_tasks='toy_curve',
        downstream_every=2,
        downstream_include_path=str(tasks),
    )
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=3))
    return [*cli_args(config, workdir, 'vrl.experiments.compare'), '--analysis_sequences=4', *args]


def _compare(small_corpus, workdir, *args: str, steps: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run(
        _compare_args(small_corpus, workdir, *args, steps=steps),
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=900,
    )


@pytest.fixture(scope='module')
def compared(small_corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp('compare')
    first = _compare(small_corpus, workdir, '--variants=vanilla,resformer:learnable_plus', '--seeds=0,1')
    assert first.returncode == 0, first.stderr[-3000:]
    return workdir, first


def test_compare_writes_report_results_and_plots(compared):
    workdir, first = compared
    results = json.loads((workdir / 'results.json').read_text())
    assert [r['variant'] for r in results['table']] == ['vanilla', 'resformer:learnable_plus']
    assert len(results['runs']) == 4 and {r['seed'] for r in results['runs']} == {0, 1}
    for run in results['runs']:
        assert run['step'] == 4 and np.isfinite(run['eval_loss']) and len(run['train_loss']) == 4
        assert len(run['analysis']['entropy']) == 3
        assert sorted(run['diagnostics']) == ['2', '4'] and len(run['diagnostics']['4']['entropy']) == 3
    resformer = results['table'][1]
    assert resformer['params'] > results['table'][0]['params']  # learnable_plus adds 2 N + 1 scalars
    # the console says what ± is and judges each difference against the spread, as report.md's table does
    assert 'final eval loss, mean ± standard deviation over seeds 0,1:' in first.stdout
    assert re.search(
        r'^resformer:learnable_plus: .* \((exceeds|within) the spread [\d.]+ \(2 seeds\)', first.stdout, re.M
    )
    assert f'| {resformer["judgement"]} |' in (workdir / 'report.md').read_text()
    report = (workdir / 'report.md').read_text()
    # a row in the main table and one in the downstream table
    assert report.count('| vanilla |') == 2 and report.count('| resformer:learnable_plus |') == 2
    for name in (
        'eval_loss',
        'relative_train_loss',
        'entropy',
        'similarity',
        'value_norms',
        'diagnostics_first_token_attention',
        'diagnostics_entropy',
        'downstream_toy_curve_acc',
    ):
        assert (workdir / f'{name}.png').read_bytes()[:4] == b'\x89PNG' and f'({name}.png)' in report
    # the curve scored while training, and its last point as the final score, mean ± spread over seeds
    for run in results['runs']:
        assert sorted(run['downstream_curves']['toy_curve/acc']) == ['2', '4']
        assert run['downstream']['toy_curve']['acc'] == run['downstream_curves']['toy_curve/acc']['4']
    finals = [r['downstream']['toy_curve']['acc'] for r in results['runs'] if r['variant'] == 'vanilla']
    assert results['table'][0]['downstream']['toy_curve']['acc'] == pytest.approx(
        [np.mean(finals), np.std(finals, ddof=1)]
    )
    assert f'| vanilla | {curves.plus_minus(np.mean(finals), np.std(finals, ddof=1))} |' in report
    assert 'resformer:learnable_plus: eval loss' in first.stdout
    # the pair, differenced by seed with its interval, and what two seeds can show, in the report and console
    (pair,) = results['differences']
    assert (pair['a'], pair['b'], pair['seeds']) == ('resformer:learnable_plus', 'vanilla', 2)
    assert f'| resformer:learnable_plus − vanilla | {pair["mean"]:+.4f} |' in report
    assert curves.what_seeds_show(2) in report and curves.what_seeds_show(2) in first.stdout
    assert re.search(r'^resformer:learnable_plus − vanilla: [-+][\d.]+, 95% interval \[', first.stdout, re.M)
    # a 4-step run evaluates at every step (at least compare.EVAL_POINTS points), so eval_loss.png is a curve
    assert all(sorted(run['eval_curve'], key=int) == ['1', '2', '3', '4'] for run in results['runs'])


def test_a_second_invocation_trains_only_the_new_variant_and_evaluates_all(compared, small_corpus, tmp_path):
    workdir, _ = compared
    before = {p.parent.name: p.stat().st_mtime_ns for p in (workdir / 'runs').glob('*/result.json')}
    assert len(before) == 4
    before_steps = {name: saved_steps(workdir / 'runs' / name) for name in before}
    tasks = write_choice_task(tmp_path / 'tasks')
    again = _compare(
        small_corpus,
        workdir,
        '--variants=vanilla,resformer:learnable_plus,svformer',
        '--seeds=0,1',
        '--tasks=toy_choice',
        f'--include_path={tasks}',
    )
    assert again.returncode == 0, again.stderr[-3000:]
    after = {p.parent.name: p for p in (workdir / 'runs').glob('*/result.json')}
    assert set(after) - set(before) == {'svformer-s0', 'svformer-s1'}
    assert all(saved_steps(workdir / 'runs' / name) == before_steps[name] for name in before)  # not retrained
    assert again.stdout.count('finished before, reused') == 4
    results = json.loads((workdir / 'results.json').read_text())
    table = results['table']
    assert [r['variant'] for r in table] == ['vanilla', 'resformer:learnable_plus', 'svformer']
    assert table[2]['kv_cache_bytes_per_token'] < table[0]['kv_cache_bytes_per_token']
    # every run, reused or new, was evaluated on the task; the table has the mean over seeds
    for name, result_file in after.items():
        lm_eval_results = json.loads(next((workdir / 'runs' / name / 'lm_eval').glob('results_*.json')).read_text())
        run_acc = json.loads(result_file.read_text())['downstream']['toy_choice']['acc']
        assert run_acc == lm_eval_results['results']['toy_choice']['acc,none']
    accuracies = [r['downstream']['toy_choice']['acc'] for r in results['runs'] if r['variant'] == 'svformer']
    assert table[2]['downstream']['toy_choice']['acc'][0] == pytest.approx(np.mean(accuracies))
    assert '| variant | toy_choice acc | toy_curve acc |' in (workdir / 'report.md').read_text()


@pytest.mark.parametrize(
    'args, message',
    [
        (
            ['--variants=vanilla,resformer:learned'],
            "unknown variant preset 'resformer:learned'; did you mean 'resformer:learnable'",
        ),
        (['--variants='], '--variants is empty'),
        (['--variants=vanilla,svformer', '--baseline=resformer'], '--baseline=resformer is not among --variants'),
        (['--variants=vanilla', '--seeds=0,x'], '--seeds=0,x is invalid'),
    ],
)
def test_bad_variants_are_refused_before_anything_is_written(small_corpus, tmp_path, args, message):
    result = _compare(small_corpus, tmp_path / 'new', *args)
    assert result.returncode != 0 and message in result.stderr and 'Traceback' not in result.stderr
    assert not (tmp_path / 'new').exists()


def test_a_workdir_of_another_config_is_refused_and_left_alone(compared, small_corpus):
    workdir, _ = compared
    saved = (workdir / 'compare.json').read_bytes()
    result = _compare(small_corpus, workdir, '--variants=vanilla', steps=5)
    assert result.returncode != 0 and 'train.steps was 4 there and is 5 now' in result.stderr
    assert (workdir / 'compare.json').read_bytes() == saved
    assert not (workdir / 'runs' / 'vanilla-s0' / 'checkpoints' / '5').exists()


def test_a_second_comparison_on_the_same_directory_is_refused_naming_the_first(small_corpus, tmp_path):
    first = subprocess.Popen(
        _compare_args(small_corpus, tmp_path, '--variants=vanilla', steps=2000),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # the lock is taken, then the record written: wait for both
        wait_for(
            lambda: (
                (tmp_path / '.lock').exists()
                and (tmp_path / '.lock').read_text()
                and (tmp_path / 'compare.json').exists()
            ),
            300,
            first,
        )
        record = (tmp_path / 'compare.json').read_bytes()
        second = _compare(small_corpus, tmp_path, '--variants=vanilla', steps=2000)
    finally:
        first.kill()
        first.wait()
    assert second.returncode != 0 and 'Traceback' not in second.stderr
    assert f'is in use by another comparison (host {os.uname().nodename}, pid {first.pid}' in second.stderr
    assert (tmp_path / 'compare.json').read_bytes() == record and not (tmp_path / 'report.md').exists()


def test_one_seed_is_reported_as_one_seed_not_as_zero_spread():
    row = dict(
        variant='resformer',
        model='resformer (identity)',
        eval_loss=3.5,
        eval_loss_spread=float('nan'),
        delta_vs_vanilla=-0.1,
        delta_spread=float('nan'),
        judgement=curves.judge([3.5], [3.6], [-0.1]),
        params=10,
        kv_cache_bytes_per_token=4,
        tokens_per_sec=1.0,
        downstream={},
    )
    report = compare_report.report([row], [], Config(), [0])
    assert '| 3.5000 (1 seed) | -0.1000 (1 seed) | no spread known (1 seed): not a finding |' in report
    assert '±' not in report.split('|---|')[-1] and curves.JUDGEMENT_RULE in report


def test_list_variants():
    out = subprocess.run(
        [sys.executable, '-m', 'vrl.experiments.compare', '--list_variants'],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        check=True,
    ).stdout
    assert 'resformer:learnable_plus' in out and 'denseformer' in out and 'cla2' in out


def test_the_ledger_holds_each_run_and_remakes_the_report_without_workdirs(compared, small_corpus, tmp_path):
    """DIR/results.jsonl has a row per finished run (fingerprint, what differs from the base, losses, curves,
    the machine, the commit); --report_only on that ledger alone, copied where no workdir is, remakes
    report.md and results.json with the same numbers as the grid with its runs; a grid whose workdirs are
    gone trains nothing its ledger holds; two halves of the ledger concatenated (one line twice) report
    the same, and a row for one run with another result is one warning naming both."""
    import shutil

    workdir, _ = compared
    variants = ['--variants=vanilla,resformer:learnable_plus', '--seeds=0,1']
    again = _compare(small_corpus, workdir, *variants)  # the runs present: every one reused
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(line) for line in (workdir / 'results.jsonl').read_text().splitlines()]
    named = {r['name']: r for r in rows}
    assert {'vanilla-s0', 'vanilla-s1', 'resformer-learnable_plus-s0', 'resformer-learnable_plus-s1'} <= set(named)
    row = named['resformer-learnable_plus-s1']
    assert row['differs']['model.lambda_mode'] == 'learnable_plus' and row['differs']['train.seed'] == 1
    assert row['tokens'] == row['step'] * row['tokens_per_step'] and row['final_train_loss'] == row['train_loss']['4']
    assert row['machine']['cores'] >= 1 and row['machine']['platform'] == 'cpu' and row['commit']
    for r in rows:  # a run recorded again (downstream scores added later) has the same losses
        assert (r['eval_loss'], r['final_train_loss']) == (
            named[r['name']]['eval_loss'],
            named[r['name']]['final_train_loss'],
        )
    with_runs = json.loads((workdir / 'results.json').read_text())

    alone = tmp_path / 'alone'
    alone.mkdir()
    shutil.copy(workdir / 'results.jsonl', alone / 'results.jsonl')
    remade = _compare(small_corpus, alone, *variants, '--report_only')
    assert remade.returncode == 0, remade.stderr[-3000:]
    assert not (alone / 'runs').exists()
    assert json.loads((alone / 'results.json').read_text())['table'] == with_runs['table']
    assert (alone / 'report.md').read_text() == (workdir / 'report.md').read_text()

    listed = _compare(small_corpus, alone, *variants, '--list')
    assert [line.split()[-1] for line in listed.stdout.splitlines()] == ['recorded'] * 4, listed.stdout
    retrained = _compare(small_corpus, alone, *variants)  # no workdir, every run in the ledger: none trains
    assert retrained.returncode == 0, retrained.stderr[-3000:]
    assert retrained.stdout.count(f'in the ledger {alone / "results.jsonl"}, reused') == 4, retrained.stdout
    assert not (alone / 'runs').exists()

    halves = tmp_path / 'halves'
    halves.mkdir()
    lines = (workdir / 'results.jsonl').read_text().splitlines(keepends=True)
    first, second = lines[: len(lines) // 2 + 1], lines[len(lines) // 2 :]  # the middle line in both
    other = json.loads(lines[0])
    other['eval_loss'] += 0.5
    other['machine']['host'] = 'elsewhere'
    (halves / 'results.jsonl').write_text(''.join(first) + ''.join(second) + json.dumps(other) + '\n' + '{"finger')
    merged = _compare(small_corpus, halves, *variants, '--report_only')
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert json.loads((halves / 'results.json').read_text())['table'] == with_runs['table']
    warnings = [line for line in merged.stderr.splitlines() if 'has two results' in line]
    assert len(warnings) == 1 and 'elsewhere' in warnings[0] and f'{other["eval_loss"]:.6f}' in warnings[0], warnings
    assert sum('is not a ledger row' in line for line in merged.stderr.splitlines()) == 1

    missing = tmp_path / 'missing'
    missing.mkdir()
    (missing / 'results.jsonl').write_text(''.join(lines[:1]))
    refused = _compare(small_corpus, missing, *variants, '--report_only')
    assert refused.returncode != 0 and 'Traceback' not in refused.stderr
    assert f"{missing / 'results.jsonl'} holds 1 of the grid's 4 runs; missing: " in refused.stderr
    assert not (missing / 'report.md').exists()


def test_a_runs_fingerprint_leaves_out_where_and_how_it_ran(small_corpus):
    """The same grid point on another machine (its data and tokenizer elsewhere, another mesh, cadence of
    checkpoints, remat) has the same fingerprint; another LR, seed or variant field does not."""
    from vrl.core.sharding import MeshConfig
    from vrl.experiments import ledger

    config = tiny_config(small_corpus, steps=4)
    elsewhere = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, data_dir='/elsewhere/tfds', tokenizer='/elsewhere/t.model'),
        train=dataclasses.replace(config.train, checkpoint_every=7, print_every=3),
        model=dataclasses.replace(config.model, remat='full'),
        mesh=MeshConfig(data=2, fsdp=4),
    )
    assert ledger.fingerprint(elsewhere) == ledger.fingerprint(config)
    for changed in (
        dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, peak_lr=1e-2)),
        dataclasses.replace(config, train=dataclasses.replace(config.train, seed=3)),
        dataclasses.replace(config, model=dataclasses.replace(config.model, lambda_mode='learnable_plus')),
    ):
        assert ledger.fingerprint(changed) != ledger.fingerprint(config)
