"""Runs trained together (vrl/train/step.py's RunGroup, train.run_group, grid.train_all): each member is
the run trained alone (losses, eval, parameters, checkpoints), a member's workdir resumes alone,
only runs of one shape, data and step are grouped, and a killed grouped comparison resumes."""

import dataclasses
import json
import signal
import subprocess

import jax
import numpy as np
import pytest

from tests.conftest import ROOT
from tests.helpers import rel_err, train_steps
from tests.runs import cli_args, saved_steps, tiny_config, wait_for
from vrl.core import sharding
from vrl.experiments import compare, grid
from vrl.train import loop
from vrl.train.rundir import checkpoint

pytestmark = pytest.mark.slow  # trains real runs and starts processes: outside the edit loop's tier

STEPS = 4


def _config(small_corpus, attention: str, seed: int, steps: int = STEPS):
    config = tiny_config(
        small_corpus, attention=attention, steps=steps, checkpoint_every=2, eval_every=2, eval_batches=1
    )
    return dataclasses.replace(config, train=dataclasses.replace(config.train, seed=seed))


@pytest.mark.parametrize('attention', ['vanilla', 'resformer', 'svformer'])
def test_a_group_step_is_each_runs_step(small_corpus, attention):
    """The vmapped step, 3 steps over one batch stream, groups of 2 and 3: each member's losses and
    parameters are the ones its run gets alone (on one device; the next test trains a group on 8, fsdp)."""
    config = _config(small_corpus, attention, 0)
    trainer = train_steps(config, sharding.make_mesh(config.mesh, jax.devices()[:1]))
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, config.model.vocab_size, (8, 33)) for _ in range(3)]
    batches = [{'inputs': t[:, :-1], 'targets': t[:, 1:], 'loss_mask': np.ones((8, 32), np.int32)} for t in tokens]
    alone = []
    for seed in range(3):
        state, losses = trainer.init_state(seed), []
        for batch in batches:
            state, out = trainer.train_step(state, trainer.device_batch(batch))
            losses.append(float(out['loss']))
        alone.append((losses, jax.device_get(state.params)))
    assert rel_err(alone[0][0], alone[1][0]) > 1e-4  # the seeds differ, so the test can fail
    for members in (2, 3):
        group = trainer.group(members)
        state, losses = group.init_state(list(range(members))), []
        for batch in batches:
            state, out = group.train_step(state, group.device_batch(batch))
            losses.append(np.asarray(out['loss']))
        for i, (expected_losses, expected_params) in enumerate(alone[:members]):
            assert rel_err(expected_losses, [step[i] for step in losses]) < 1e-5, (members, i)
            params = jax.device_get(group.member(state.params, i))
            assert all(
                rel_err(e, g) < 1e-5 for e, g in zip(jax.tree.leaves(expected_params), jax.tree.leaves(params))
            ), (members, i)


def test_a_member_is_the_run_trained_alone_and_goes_on_alone(small_corpus, tmp_path):
    """Three ResFormer seeds trained together, each against its run alone: losses, eval, parameters,
    the workdir (checkpoints a single-run TrainSteps restores, metrics, config.json); then one member
    extended alone by two steps equals its run alone extended."""
    seeds = [0, 1, 2]
    workdirs = [tmp_path / f's{seed}' for seed in seeds]
    group = loop.run_group([_config(small_corpus, 'resformer', seed) for seed in seeds], [str(w) for w in workdirs])
    for seed, workdir, result in zip(seeds, workdirs, group):
        single = loop.run(_config(small_corpus, 'resformer', seed), str(tmp_path / f'alone{seed}'))
        assert sorted(result.losses) == list(range(1, STEPS + 1))
        assert rel_err(list(single.losses.values()), list(result.losses.values())) < 1e-5
        assert result.eval_loss == pytest.approx(single.eval_loss, rel=1e-5)
        single_leaves, leaves = jax.tree.leaves(single.state.params), jax.tree.leaves(result.state.params)
        assert all(rel_err(e, g) < 1e-5 for e, g in zip(single_leaves, leaves))
        assert saved_steps(workdir) == [2, 4]
        restored = checkpoint.restore_params(str(workdir / 'checkpoints' / str(STEPS)), single.state.params)
        assert all(np.array_equal(r, g) for r, g in zip(jax.tree.leaves(restored), leaves))
        logged = grid.read_metrics(workdir)
        assert logged[STEPS]['eval_loss'] == pytest.approx(result.eval_loss)
        assert json.loads((workdir / 'config.json').read_text())['config']['train']['seed'] == seed
    extended = loop.run(_config(small_corpus, 'resformer', 1, steps=STEPS + 2), str(workdirs[1]))
    straight = loop.run(_config(small_corpus, 'resformer', 1, steps=STEPS + 2), str(tmp_path / 'alone1'))
    assert sorted(extended.losses) == [STEPS + 1, STEPS + 2]
    assert [extended.losses[s] for s in (STEPS + 1, STEPS + 2)] == pytest.approx(
        [straight.losses[s] for s in (STEPS + 1, STEPS + 2)], rel=1e-5
    )


def test_members_must_share_everything_but_the_seed(small_corpus, tmp_path):
    other_lr = _config(small_corpus, 'vanilla', 1)
    other_lr = dataclasses.replace(other_lr, optimizer=dataclasses.replace(other_lr.optimizer, peak_lr=1e-3))
    with pytest.raises(loop.TrainingError, match='differ only in train.seed'):
        loop.run_group([_config(small_corpus, 'vanilla', 0), other_lr], [str(tmp_path / 'a'), str(tmp_path / 'b')])
    assert not (tmp_path / 'a').exists()


def test_the_grid_groups_unfinished_runs_of_one_shape_data_and_step(small_corpus, tmp_path, caplog, capsys):
    """(ResFormer as above, so its programs are compiled already.)"""

    def run(attention: str, seed: int, peak_lr: float = 3e-3) -> grid.Run:
        config = _config(small_corpus, attention, seed)
        config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, peak_lr=peak_lr))
        return grid.Run(attention, seed, config, (('lr', f'{peak_lr:g}'),))

    # resformer-s2 stopped at step 2 of 4 (a run of its own, interrupted)
    partial = run('resformer', 2)
    loop.run(
        dataclasses.replace(partial.config, train=dataclasses.replace(partial.config.train, steps=2)),
        str(tmp_path / 'runs' / partial.name),
    )
    first = [run('resformer', 0), run('resformer', 1), partial, run('resformer', 3)]
    others = [run('svformer', 0), run('svformer', 1), run('resformer', 4, 1e-3)]
    names = lambda groups: [[r.name for r in g] for g in groups]  # noqa: E731
    assert names(grid.groups(first + others, tmp_path)) == [
        ['resformer-0.003-s0', 'resformer-0.003-s1', 'resformer-0.003-s3'],
        ['resformer-0.003-s2'],
        ['svformer-0.003-s0', 'svformer-0.003-s1'],
        ['resformer-0.001-s4'],
    ]

    capsys.readouterr()
    results = grid.train_all(first, tmp_path, 0)
    said = capsys.readouterr().out  # information on the terminal, not a warning in the log
    assert [r['step'] for r in results] == [STEPS] * 4
    assert '\nresformer-0.003-s0, resformer-0.003-s1, resformer-0.003-s3: trained together' in '\n' + said
    assert '\nresformer-0.003-s2: trained alone' in '\n' + said and 'trained' not in caplog.text
    events = [
        r['event']
        for r in map(json.loads, (tmp_path / 'runs' / partial.name / 'metrics.jsonl').read_text().splitlines())
        if 'event' in r
    ]
    assert events == ['started', 'resumed']
    # a group whose members are partly finished trains only the unfinished ones
    grid.train_all([*first, run('resformer', 5)], tmp_path, 0)
    said = capsys.readouterr().out
    assert said.count('finished before, reused') == 4 and 'resformer-0.003-s5: trained alone' in said
    # group_runs=False (compare's --group_runs=false): one run after another, each printing as a run alone
    alone = grid.train_all([run('resformer', 6), run('resformer', 7)], tmp_path, 0, group_runs=False)
    printed = capsys.readouterr().out
    assert [r['step'] for r in alone] == [STEPS] * 2 and 'trained together' not in printed
    assert printed.count('resformer (learnable)') == 2 and '[resformer-0.003-s6]' not in printed, printed


def test_a_killed_grouped_comparison_resumes_to_the_uninterrupted_report(small_corpus, tmp_path):
    config = _config(small_corpus, 'vanilla', 0, steps=12)
    args = [
        *cli_args(config, tmp_path / 'killed', 'vrl.experiments.compare'),
        '--variants=resformer',
        '--seeds=0,1',
        '--analysis_sequences=0',
    ]
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    members = [tmp_path / 'killed' / 'runs' / f'resformer-s{seed}' for seed in (0, 1)]
    try:
        wait_for(lambda: all(4 in saved_steps(m) for m in members), 300, first)
    finally:
        first.send_signal(signal.SIGKILL)
        output = first.communicate()[0]
    assert 'resformer-s0, resformer-s1: trained together' in output
    assert not (tmp_path / 'killed' / 'report.md').exists()
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    killed_seconds = {}
    for m in members:
        records = list(map(json.loads, (m / 'metrics.jsonl').read_text().splitlines()))
        events = [r['event'] for r in records if 'event' in r]
        assert events == ['started', 'resumed'] and all(r['group_size'] == 2 for r in records if 'event' in r)
        # each invocation's wall time up to its last logged step, shared by the 2 seeds trained together
        resumed_at = next(i for i, r in enumerate(records) if r.get('event') == 'resumed')
        walls = [
            [r['wall_seconds'] for r in part if 'wall_seconds' in r]
            for part in (records[:resumed_at], records[resumed_at:])
        ]
        assert all(walls) and walls[0][-1] > 0.5, walls  # the killed invocation compiled and trained: it counts
        killed_seconds[m.name] = (walls[0][-1] + walls[1][-1]) / 2

    straight, _ = compare.compare(config, ['resformer'], [0, 1], tmp_path / 'straight', 0)
    killed = json.loads((tmp_path / 'killed' / 'results.json').read_text())
    assert [row['eval_loss'] for row in killed['table']] == pytest.approx(
        [row['eval_loss'] for row in straight], rel=1e-5
    )
    uninterrupted = json.loads((tmp_path / 'straight' / 'results.json').read_text())
    # results.json's seconds add up both invocations (no analysis here: training alone)
    assert {r['variant'] + '-s' + str(r['seed']): r['seconds'] for r in killed['runs']} == pytest.approx(
        killed_seconds, abs=0.3
    )
    for resumed, whole in zip(killed['runs'], uninterrupted['runs']):
        assert resumed['eval_curve'] == pytest.approx(whole['eval_curve'], rel=1e-5)
        assert resumed['train_loss'] == pytest.approx(whole['train_loss'], rel=1e-5)
