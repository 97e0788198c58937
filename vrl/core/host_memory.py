"""Transparent huge pages for XLA:CPU's large host allocations (Linux, glibc >= 2.35).

XLA:CPU allocates a program's temporary buffers afresh on every run. glibc serves allocations
that large with mmap and unmaps them when they are freed, so every train step page-faults all of
that memory again, 4 KiB at a time: for the 82M model at batch 4 x 512 on 2 cores, about 500,000
faults and 1.1 s of kernel time per 4.5 s step. With the glibc tunable glibc.malloc.hugetlb=1,
malloc asks the kernel for 2 MiB transparent huge pages for those mappings (which the kernel's
default 'madvise' mode grants): about 1,300 faults and 0.3 s.

glibc reads GLIBC_TUNABLES once, when a process starts, so `use_huge_pages` restarts the Python
process with it (os.execve: same pid, same command line). VRL_HUGE_PAGES=0 leaves it alone. The
commands in COMMANDS restart when `vrl` is imported (`restart_command`), before anything else is, so
the restart costs an interpreter's start, not the command's imports (jax, flax, the model: about 2 CPU
seconds).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = 'glibc.malloc.hugetlb=1'
THP_MODE_FILE = Path('/sys/kernel/mm/transparent_hugepage/enabled')
# The commands whose XLA:CPU steps huge pages speed up (training, decoding; docs/training.md has the
# figures), by module and by console script. Scoring with lm-eval is not one (about 5% slower).
COMMANDS = {
    'vrl.main': 'vrl-train',
    'vrl.tools.generate': 'vrl-generate',
    'vrl.experiments.compare': 'vrl-compare',
    'vrl.experiments.study': 'vrl-study',
}
PYTHON_OPTIONS_WITH_VALUES = ('-W', '-X', '--check-hash-based-pycs')


def tunables_with_huge_pages(environ: dict[str, str], libc: tuple[str, str], thp_modes: str) -> str | None:
    """The GLIBC_TUNABLES value to restart with, or None where it would change nothing.

    environ: the process environment; libc: `platform.libc_ver()`; thp_modes: the contents of
    THP_MODE_FILE, the selected mode in brackets ('always [madvise] never').
    """
    current = environ.get('GLIBC_TUNABLES', '')
    if environ.get('VRL_HUGE_PAGES') == '0' or 'glibc.malloc.hugetlb' in current:
        return None
    name, version = libc
    if name != 'glibc' or tuple(int(p) for p in version.split('.')[:2]) < (2, 35):
        return None  # older glibc has no hugetlb tunable
    if '[madvise]' not in thp_modes:
        return None  # 'always' already backs large mappings with huge pages; 'never' refuses them
    return f'{current}:{TUNABLE}' if current else TUNABLE


def use_huge_pages() -> None:
    """Restarts this Python process with glibc's huge-page malloc where it applies; returns otherwise.

    Call it first thing in a program's entry point, before any work is done.
    """
    if sys.platform != 'linux' or not sys.executable or not THP_MODE_FILE.exists():
        return
    tunables = tunables_with_huge_pages(dict(os.environ), platform.libc_ver(), THP_MODE_FILE.read_text())
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, 'GLIBC_TUNABLES': tunables})


def command(argv: list[str]) -> str | None:
    """The command module that `argv` (a process's `sys.orig_argv`) runs, `python [options] -m <module>`
    or a console script of COMMANDS; None for anything else (`-c`, another script, the REPL)."""
    options = iter(argv[1:])
    for arg in options:
        if arg in PYTHON_OPTIONS_WITH_VALUES:
            next(options, None)
        elif arg.startswith('-m'):
            return arg[2:] or next(options, None)
        elif arg == '-c' or arg == '-':
            return None
        elif not arg.startswith('-'):
            return next((module for module, script in COMMANDS.items() if script == Path(arg).name), None)
    return None


def restart_command(argv: list[str]) -> None:
    """Restarts a process that runs one of COMMANDS with huge-page malloc (`use_huge_pages`); returns
    in any other."""
    if command(argv) in COMMANDS:
        use_huge_pages()
