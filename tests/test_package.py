"""vrl as a package (pyproject.toml): its wheel holds vrl and the presets, declares the requirement
files' dependencies, and installs commands that run from any folder. Built and installed offline
(no build isolation, no index, no dependencies: the suite's environment has them)."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.runs import ROOT

pytestmark = pytest.mark.slow  # builds and installs a wheel


def _requirements(name: str) -> list[str]:
    return [
        line.strip() for line in (ROOT / name).read_text().splitlines() if line.strip() and not line.startswith('#')
    ]


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
    """Built from a copy of what pyproject.toml packages (the build writes build/ and *.egg-info beside it)."""
    source, out = tmp_path_factory.mktemp('source'), tmp_path_factory.mktemp('wheel')
    for name in ('pyproject.toml', 'README.md', *(p.name for p in ROOT.glob('requirements*.txt'))):
        shutil.copy(ROOT / name, source / name)
    for name in ('vrl', 'configs'):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns('__pycache__'))
    built = subprocess.run(
        [
            sys.executable,
            '-m',
            'pip',
            'wheel',
            '--no-deps',
            '--no-build-isolation',
            '--no-index',
            '-q',
            '-w',
            str(out),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (found,) = out.glob('vrl-*.whl')
    return found


def test_the_wheel_holds_vrl_the_presets_and_the_requirement_files_dependencies(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert 'vrl/main.py' in names and 'vrl/interop/hf_modeling/modeling_vrl.py' in names
    assert {'configs/tiny.py', 'configs/base.py', 'configs/svformer_468m.py'} <= set(names)
    assert not [n for n in names if n.startswith(('tests/', 'bench/', 'docs/'))]
    info = email.message_from_bytes(
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith('.dist-info/METADATA')))
    )
    requires = info.get_all('Requires-Dist')
    assert [r for r in requires if 'extra ==' not in r] == _requirements('requirements.txt')
    for extra, file in (
        ('extra', 'requirements-extra.txt'),
        ('tpu', 'requirements-tpu.txt'),
        ('test', 'requirements-test.txt'),
    ):
        assert len([r for r in requires if f'extra == "{extra}"' in r]) == len(_requirements(file)), (extra, requires)
    scripts = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith('entry_points.txt'))).decode()
    assert re.findall(r'^(vrl-\w+) = ', scripts, re.M) == [
        'vrl-analyze',
        'vrl-compare',
        'vrl-data',
        'vrl-evaluate',
        'vrl-export',
        'vrl-generate',
        'vrl-study',
        'vrl-tokenizer',
        'vrl-train',
    ]


def test_installed_commands_run_outside_a_checkout_with_the_presets(wheel, tmp_path):
    """Installed into a folder of its own and run from another folder (no checkout on the path): the
    training command reads the installed preset that `--config=configs/...` names; a usage error names
    the command as it was called."""
    target = tmp_path / 'site'
    installed = subprocess.run(
        [sys.executable, '-m', 'pip', 'install', '--no-deps', '--no-index', '-q', '--target', str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    env = {**os.environ, 'PYTHONPATH': str(target), 'HOME': str(tmp_path / 'home')}

    def run(*args: str) -> subprocess.CompletedProcess:  # from elsewhere, with the installed copy only
        return subprocess.run(
            [sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
        )

    summary = run(str(target / 'bin/vrl-train'), '--config=configs/svformer_468m.py', '--summary')
    assert summary.returncode == 0, summary.stderr[-3000:]
    assert re.search(r'^variant +svformer$', summary.stdout, re.M) and 'step time, estimated' in summary.stdout, (
        summary.stdout
    )
    found = run('-c', 'import vrl, configs; print(vrl.__file__, configs.__file__)')
    assert found.stdout.split() == [str(target / 'vrl/__init__.py'), str(target / 'configs/__init__.py')]
    usage = run(str(target / 'bin/vrl-data'))
    assert usage.returncode != 0 and 'usage: vrl-data prepare|tokenize|stats [--flags]' in usage.stderr, usage.stderr
    helped = run(str(target / 'bin/vrl-train'), '--help')
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert 'flags of vrl-train:' in helped.stdout and '\n  --init_from: ' in helped.stdout, helped.stdout


def _scripts() -> dict[str, str]:
    """pyproject.toml's console scripts: name -> module."""
    import tomllib

    scripts = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
    return {name: target.split(':')[0] for name, target in scripts.items()}


@pytest.mark.parametrize('script', sorted(_scripts()))
def test_help_lists_the_commands_own_flags_and_exits_0(script):
    """`python -m MODULE --help` for every command: its docstring, then each of its own flags (not
    absl's or JAX's), exit 0; --helpfull adds every other flag, exit 0 too."""
    module = _scripts()[script]
    helped = subprocess.run(
        [sys.executable, '-m', module, '--help'], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert helped.returncode == 0, helped.stderr[-3000:]
    doc = sys.modules.get(module) or __import__(module, fromlist=['_'])
    assert helped.stdout.startswith(doc.__doc__.strip().splitlines()[0]), helped.stdout[:500]
    listed = re.findall(r'^  --(?:\[no\])?(\w+): ', helped.stdout, re.M)
    assert listed and 'verbosity' not in listed and 'jax_platforms' not in listed, helped.stdout
    assert f'flags of python -m {module.removesuffix(".__main__")}:' in helped.stdout
    full = subprocess.run(
        [sys.executable, '-m', module, '--helpfull'], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert full.returncode == 0 and '--verbosity' in full.stdout
    assert all(re.search(rf'--(\[no\])?{f}: ', full.stdout) for f in listed), full.stdout
