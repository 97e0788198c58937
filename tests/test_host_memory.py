"""vrl/core/host_memory.py: when the restart applies, and that glibc's malloc then asks the kernel for huge pages."""

import os
import platform
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT
from vrl.core import host_memory

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier

GLIBC = ('glibc', '2.36')
MADVISE = 'always [madvise] never'


@pytest.mark.parametrize(
    'environ, libc, thp_modes, expected',
    [
        ({}, GLIBC, MADVISE, 'glibc.malloc.hugetlb=1'),
        (
            {'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'},
            GLIBC,
            MADVISE,
            'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1',
        ),
        ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, GLIBC, MADVISE, None),  # the user's own setting stands
        ({'VRL_HUGE_PAGES': '0'}, GLIBC, MADVISE, None),
        ({}, ('glibc', '2.31'), MADVISE, None),  # no hugetlb tunable before 2.35
        ({}, ('', ''), MADVISE, None),  # not glibc
        ({}, GLIBC, '[always] madvise never', None),
        ({}, GLIBC, 'always madvise [never]', None),
    ],
)
def test_when_the_restart_applies(environ, libc, thp_modes, expected):
    assert host_memory.tunables_with_huge_pages(environ, libc, thp_modes) == expected


_PROBE = """
import ctypes, re
from vrl.core import host_memory
print('started', flush=True)
host_memory.use_huge_pages()
libc, size = ctypes.CDLL(None), 256 * 2**20  # glibc's malloc, as XLA:CPU's buffers get (numpy madvises its own)
libc.malloc.restype = ctypes.c_void_p
address, flags = libc.malloc(size), None
ctypes.memset(address, 1, size)
for line in open('/proc/self/smaps'):  # the mapping holding the buffer, and its VmFlags
    if bounds := re.match(r'([0-9a-f]+)-([0-9a-f]+) ', line):
        holds = int(bounds[1], 16) <= address < int(bounds[2], 16)
    elif line.startswith('VmFlags:') and holds:
        flags = line.split()[1:]
print('advised' if 'hg' in flags else 'not-advised')
"""


def _malloc_advice(extra_env: dict[str, str]) -> list[str]:
    """The probe's lines: 'started' at each start, then whether a 256 MiB malloc's mapping carries
    MADV_HUGEPAGE (VmFlags 'hg'). Whether the kernel then backs it with huge pages depends on the
    free memory at the time; bench/train_throughput.py measures a step with and without."""
    env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', 'VRL_HUGE_PAGES')}
    return subprocess.run(
        [sys.executable, '-c', _PROBE], cwd=ROOT, env={**env, **extra_env}, capture_output=True, text=True, check=True
    ).stdout.split()


def _skip_unless_huge_pages_apply() -> None:
    modes = host_memory.THP_MODE_FILE.read_text() if host_memory.THP_MODE_FILE.exists() else ''
    if host_memory.tunables_with_huge_pages({}, platform.libc_ver(), modes) is None:
        pytest.skip(f'huge-page malloc does not apply here (libc {platform.libc_ver()}, THP "{modes.strip()}")')


def test_restart_once_and_malloc_asks_for_huge_pages():
    _skip_unless_huge_pages_apply()
    assert _malloc_advice({}) == ['started', 'started', 'advised']
    assert _malloc_advice({'VRL_HUGE_PAGES': '0'}) == ['started', 'not-advised']


def test_a_training_command_restarts_before_its_imports():
    """`python -m vrl.main` restarts when `vrl` is imported: jax is imported once, after the restart
    (vrl.core.host_memory twice, once per start); with VRL_HUGE_PAGES=0 it starts once."""
    _skip_unless_huge_pages_apply()
    env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', 'VRL_HUGE_PAGES')}
    for extra, starts in (({}, 2), ({'VRL_HUGE_PAGES': '0'}, 1)):
        said = subprocess.run(
            [sys.executable, '-X', 'importtime', '-m', 'vrl.main', '--config=no_such_config.py'],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
        ).stderr
        imported = [line.rsplit('|', 1)[1].strip() for line in said.splitlines() if line.startswith('import time:')]
        assert imported.count('vrl.core.host_memory') == starts and imported.count('jax') == 1, (extra, said[-2000:])
        assert 'no_such_config.py' in said.splitlines()[-1], said[-2000:]


@pytest.mark.parametrize(
    'argv, expected',
    [
        (['python', '-m', 'vrl.main', '--config=c.py'], 'vrl.main'),
        (['python', '-u', '-X', 'importtime', '-mvrl.tools.generate'], 'vrl.tools.generate'),
        (['python', '-W', 'ignore', '-m', 'vrl.data', 'prepare'], 'vrl.data'),
        (['/venv/bin/python', '/venv/bin/vrl-study', '--grid=g.py'], 'vrl.experiments.study'),
        (['/venv/bin/python', '/venv/bin/vrl-evaluate'], None),
        (['python', '-c', 'import vrl.main'], None),
        (['python', 'bench/decode.py'], None),
        (['python'], None),
    ],
)
def test_the_command_a_process_runs_is_read_off_its_command_line(argv, expected):
    assert host_memory.command(argv) == expected


def test_the_commands_console_scripts_are_pyprojects():
    scripts = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
    for module, script in host_memory.COMMANDS.items():
        assert scripts[script] == f'{module}:cli_main', (script, scripts.get(script))
