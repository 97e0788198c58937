"""Studies on a real SLURM (tests/slurm_cluster.py: slurmctld, slurmd and munge on 127.0.0.1): every
seed group a task of one job array, a task cancelled mid-run and submitted again, the report equal to
the same study run here; bad input refused in one line with nothing submitted."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.conftest import ROOT
from tests.runs import cli_args, saved_steps, tiny_config
from vrl.experiments import grid_job

pytestmark = pytest.mark.slow  # a cluster's daemons and real runs: outside the edit loop's tier
needs_slurm = pytest.mark.skipif(bool(slurm_cluster.missing()), reason=slurm_cluster.missing() or '')
AXES = ['--variants=vanilla,svformer', '--lrs=1e-3,3e-3', '--seeds=0,1', '--sizes=base']


@pytest.fixture(scope='module')
def slurm(tmp_path_factory):
    if slurm_cluster.missing():
        pytest.skip(slurm_cluster.missing())
    with slurm_cluster.cluster(tmp_path_factory.mktemp('slurm')) as env:
        yield env


def _args(small_corpus, workdir: Path, *flags: str) -> list[str]:
    config = tiny_config(small_corpus, steps=40, checkpoint_every=1, log_every=1, eval_every=20, keep_checkpoints=2)
    return [*cli_args(config, workdir, 'vrl.experiments.study'), *AXES, *flags]


@needs_slurm
def test_a_study_on_slurm_with_a_task_cancelled_reports_what_it_does_here(slurm, small_corpus, tmp_path):
    """2 variants x 2 LRs x 2 seeds: 4 seed groups, one job array of 4 tasks; task 0 is cancelled
    (scancel: SIGTERM, the run saves and stops) once its runs have checkpoints, and is submitted again,
    resuming them; study.md and every run's losses equal the same study trained here, and each run
    is in the ledger once."""
    workdir = tmp_path / 'on_slurm'
    flags = ['--launcher=slurm', '--workdir_shared', '--poll_seconds=0.5']
    listed = subprocess.run(
        _args(small_corpus, workdir, *flags, '--list'), cwd=ROOT, env=slurm, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert '4 SLURM job(s), one array' in listed.stdout and '#SBATCH --array=0,1,2,3' in listed.stdout, listed.stdout
    assert not (workdir / 'jobs').exists()  # --list submits nothing

    study = subprocess.Popen(
        _args(small_corpus, workdir, *flags),
        cwd=ROOT,
        env=slurm,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    while not any(line.startswith('submitted SLURM job array') for line in lines):
        line = study.stdout.readline()
        assert line, ''.join(lines)[-3000:]
        lines.append(line)
    job_id = lines[-1].split()[4]
    first = json.loads((workdir / 'jobs' / '0.json').read_text())
    run_dirs = [workdir / 'runs' / run.name for run in grid_job.runs_of(first)]
    deadline = time.monotonic() + 300
    while not all(max(saved_steps(d), default=0) >= 3 for d in run_dirs):
        assert time.monotonic() < deadline and study.poll() is None, ''.join(lines)[-3000:]
        time.sleep(0.05)
    subprocess.run(['scancel', f'{job_id}_0'], env=slurm, check=True)
    output, _ = study.communicate(timeout=900)
    output = ''.join(lines) + output
    assert study.returncode == 0, output[-3000:]
    assert '1 job(s) ended without their results (failed, preempted or cancelled): 0 (' in output, output[-3000:]
    assert output.count('submitted SLURM job array') == 2, output[-3000:]
    for run_dir in run_dirs:  # the resubmitted task resumed its runs from their checkpoints
        events = [json.loads(l).get('event') for l in (run_dir / 'metrics.jsonl').read_text().splitlines()]
        assert [e for e in events if e] == ['started', 'resumed'], (run_dir, events)

    here = tmp_path / 'here'
    local = subprocess.run(_args(small_corpus, here), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert local.returncode == 0, local.stderr[-3000:]
    on_slurm, locally = (json.loads((d / 'results.json').read_text()) for d in (workdir, here))
    by_name = lambda results: {(r['variant'], r['peak_lr'], r['seed']): r for r in results['runs']}  # noqa: E731
    assert by_name(on_slurm).keys() == by_name(locally).keys() and len(by_name(locally)) == 8
    for key, run in by_name(locally).items():
        assert by_name(on_slurm)[key]['eval_loss'] == pytest.approx(run['eval_loss'], rel=1e-5), key
        assert by_name(on_slurm)[key]['train_loss'] == pytest.approx(run['train_loss'], rel=1e-5), key
    assert len((workdir / 'results.jsonl').read_text().splitlines()) == 8


@needs_slurm
def test_a_partition_the_cluster_lacks_is_one_line_and_nothing_is_submitted(slurm, small_corpus, tmp_path):
    refused = subprocess.run(
        _args(small_corpus, tmp_path / 'w', '--launcher=slurm', '--workdir_shared', '--slurm_partition=nope'),
        cwd=ROOT,
        env=slurm,
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and 'Traceback' not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        'error: --launcher=slurm: the cluster refuses the job: invalid partition specified: nope '
        '(nothing was submitted).'
    ], refused.stderr
    assert not (tmp_path / 'w').exists()
    queue = subprocess.run(['squeue', '-h'], env=slurm, capture_output=True, text=True)
    assert queue.stdout.strip() == ''


def test_sbatch_missing_or_a_workdir_the_nodes_cannot_see_is_one_line(small_corpus, tmp_path):
    """No SLURM needed: sbatch not on PATH, and a local workdir (this machine's own disk) for SLURM or
    for TPU slices, each refused in one line naming the fix, with nothing written."""
    bin_dir = tmp_path / 'bin'  # a PATH with no sbatch (the command itself by its full path)
    bin_dir.mkdir()
    cases = [
        (
            {'PATH': str(bin_dir)},
            ['--launcher=slurm', '--workdir_shared'],
            'error: --launcher=slurm: sbatch is not on PATH: run this on a SLURM login node',
        ),
        ({}, ['--launcher=slurm'], '--workdir_shared if every node mounts it at this path (nothing was submitted).'),
        ({}, ['--launcher=tpu', '--tpu_repo=https://example.invalid/vrl.git'], "is on this machine's own disk"),
    ]
    for env, flags, message in cases:
        args = _args(small_corpus, tmp_path / 'w', *flags)
        refused = subprocess.run(args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
        assert refused.returncode != 0 and 'Traceback' not in refused.stderr, refused.stderr[-2000:]
        assert len(refused.stderr.strip().splitlines()) == 1 and message in refused.stderr, refused.stderr
        assert not (tmp_path / 'w').exists()


def test_tpu_slices_are_launch_scripts_steps_per_job(small_corpus, gcs):
    """--launcher=tpu --list: per seed group, launch/tpu_pod.sh's create, install, job and delete for a
    slice of its own; each of those commands runs as written under the script's --dry-run."""
    args = _args(
        small_corpus, 'gs://vrl/study', '--launcher=tpu', '--tpu_repo=https://example.invalid/vrl.git', '--list'
    )
    listed = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr[-3000:]
    commands = [line.split() for line in listed.stdout.splitlines() if line.startswith('  bash ')]
    assert len(commands) == 4 * 4 and [c[2] for c in commands[:4]] == ['create', 'install', 'job', 'delete']
    assert '--spec=gs://vrl/study/jobs/0.json' in commands[2]
    job = subprocess.run([*commands[2][:2], '--dry-run', *commands[2][2:]], cwd=ROOT, capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    said = shlex.split(job.stdout)  # the command as the dry run quotes it
    assert said[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'vrl-grid-0'], said
    assert said[-1].endswith('python -m vrl.experiments.grid_job --spec=gs://vrl/study/jobs/0.json'), said
