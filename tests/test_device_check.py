"""The device check (bench/device_check.py) cannot rot: its every part runs here on the CPU in dry
mode, so a renamed flag or script fails here rather than in a GPU window of minutes; what vrl
needs is either on the lent machine or among the wheels sent to it (bench/device_wheels.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from bench import device_check, device_wheels
from tests.runs import ROOT, host_xla_flags


def _normal(name: str) -> str:
    return re.sub(r'[-_.]+', '-', name).lower()


def test_every_runtime_requirement_is_on_the_device_or_among_its_wheels():
    """requirements.txt names what vrl imports; each must reach the GPU machine one way or the other."""
    required = {
        _normal(re.split(r'[<>=\[;# ]', line.strip())[0])
        for line in (ROOT / 'requirements.txt').read_text().splitlines()
        if line.strip() and not line.startswith('#')
    }
    covered = {_normal(n) for n in device_wheels.NEEDED + device_wheels.ON_THE_DEVICE}
    assert required - covered == set(), required - covered
    assert len(required) > 15


@pytest.mark.slow  # every part's command, tiny (the GPU tests collected, not run): 70 s on 2 quiet cores
def test_the_device_check_runs_every_part_dry_and_resumes(tmp_path):
    out, state = tmp_path / 'check', tmp_path / 'state'
    env = dict(os.environ, XLA_FLAGS=host_xla_flags(1))  # one device, as the lent machine has one GPU
    first = subprocess.run(
        [sys.executable, 'bench/device_check.py', '--out', str(out), '--state', str(state), '--dry'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    record = json.loads((out / 'device_check.json').read_text())
    assert [p['part'] for p in record['parts']] == [p.name for p in device_check.PARTS]
    assert all(p['status'] == 'passed' for p in record['parts']), [
        (p['part'], p['output'][-500:]) for p in record['parts']
    ]
    assert record['device'].endswith('(cpu)') and record['jax'] and record['commit']
    report = (out / 'device_check.md').read_text()
    assert report.startswith(f'# Device check: {record["device"]}, jax {record["jax"]}, commit {record["commit"]}')
    parts = {p['part']: p['output'] for p in record['parts']}
    assert re.search(r'tiny \| +svformer \|.*\| +[\d.]+%', parts['train_82m'])  # a row with its MFU
    assert (
        re.search(r'\b[1-9]\d*/\d+ tests collected', parts['gpu_tests'])
        and 'model.attention_impl=' in parts['auto_468m']
    )
    # a second command, into a new OUT as a lent machine gives each command: what passed is kept
    again = subprocess.run(
        [sys.executable, 'bench/device_check.py', '--out', str(tmp_path / 'again'), '--state', str(state), '--dry'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert again.returncode == 0 and again.stdout.count('passed before, kept') == len(device_check.PARTS), again.stdout
    assert json.loads((tmp_path / 'again' / 'device_check.json').read_text())['parts'] == record['parts']


def test_a_part_that_is_not_one_is_refused_in_one_line(tmp_path):
    said = subprocess.run(
        [sys.executable, 'bench/device_check.py', '--out', str(tmp_path), '--parts', 'train'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert said.returncode == 1 and said.stderr.strip().startswith("error: --parts names ['train']; allowed: gpu_tests")
