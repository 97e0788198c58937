"""No TPU runtime where there is no TPU: libtpu's start-up errors never reach a CPU user."""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.runs import cli_args, tiny_config
from vrl.core import backend

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


def test_tpu_chips_are_counted_on_the_pci_bus(tmp_path):
    for name, vendor in (('0000:00:04.0', '0x1ae0'), ('0000:00:05.0', '0x1ae0'), ('0000:00:06.0', '0x10de')):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'vendor').write_text(vendor + '\n')
    assert backend.tpu_chips(tmp_path) == 2
    assert backend.tpu_chips(tmp_path / 'absent') == 0


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed')
def test_platforms_without_tpu_chips():
    environ = {}
    backend.skip_absent_tpu(environ)
    assert environ['JAX_PLATFORMS'].split(',')[-1] == 'cpu' and 'tpu' not in environ['JAX_PLATFORMS']
    chosen = {'JAX_PLATFORMS': 'tpu'}
    backend.skip_absent_tpu(chosen)  # the user's choice stands
    assert chosen == {'JAX_PLATFORMS': 'tpu'}


def test_a_host_without_tpu_chips_is_named_for_a_slice_description(monkeypatch):
    environ = {'TPU_WORKER_ID': '3'}
    backend.name_absent_tpu_host('v5litepod-16', environ)
    assert environ == {
        'TPU_ACCELERATOR_TYPE': 'v5litepod-16',
        'TPU_WORKER_HOSTNAMES': 'localhost',
        'TPU_WORKER_ID': '3',
    }  # a value already set stands
    monkeypatch.setattr(backend, 'tpu_chips', lambda: 4)  # a TPU VM: libtpu asks its metadata
    on_tpu_vm = {}
    backend.name_absent_tpu_host('v5litepod-16', on_tpu_vm)
    assert on_tpu_vm == {}


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed')
def test_commands_print_no_error_lines_on_cpu(small_corpus, tmp_path):
    environ = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
    summary = subprocess.run(
        [sys.executable, '-m', 'vrl.main', '--config=configs/tiny.py', '--summary'],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
    )
    run = subprocess.run(
        cli_args(tiny_config(small_corpus, steps=2, checkpoint_every=2), tmp_path / 'run'),
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
    )
    for out in (summary, run):
        assert out.returncode == 0, out.stderr[-2000:]
        printed = out.stdout + out.stderr
        for error_mark in ('E0000', 'INVALID_ARGUMENT', 'Failed to find host bounds'):
            assert error_mark not in printed
    assert 'step 2/2' in run.stdout
