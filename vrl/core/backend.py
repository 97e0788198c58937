"""Which JAX platforms a vrl process starts, and with which CPU options: no TPU runtime where there
is no TPU; oneDNN's matmul kernels where the CPU has AMX.

With libtpu installed (requirements-tpu.txt, for ahead-of-time TPU compiles) JAX also starts the
TPU runtime on machines without TPU chips; it fails, prints `Failed to find host bounds...` and
`E0000 ... INVALID_ARGUMENT` lines that read like errors, and JAX falls back to the other
platforms. `skip_absent_tpu`, called when `vrl` is imported, sets JAX_PLATFORMS to the platforms
that can start instead (GPU plugins that are installed, then CPU) when libtpu is installed, no
TPU chip is on the PCI bus and JAX_PLATFORMS is not set already. On a TPU VM nothing changes.
Describing a TPU slice for an ahead-of-time compile starts libtpu on purpose: `name_absent_tpu_host`
keeps that quiet too.

`choose_cpu_options`, called when `vrl` is imported too, adds XLA:CPU's oneDNN custom call
(ONEDNN_FLAG) to XLA_FLAGS on a CPU with AMX tiles, where oneDNN's bf16 matmuls run at the tiles'
rate and XLA's own kernels do not (docs/performance.md, "bfloat16 on AMX"); elsewhere it stays
off. VRL_CPU_ONEDNN=1 or 0 decides instead, and an XLA_FLAGS that names the flag is left as it is.
The train step, decoding and scoring all run under the process's XLA_FLAGS.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pkgutil
import re
from pathlib import Path

GOOGLE_PCI_VENDOR = '0x1ae0'  # TPU chips
GPU_PLATFORMS = ('cuda', 'rocm')  # JAX's GPU plugins are packages named jax_<platform><version>_plugin


def tpu_chips(pci_devices: Path = Path('/sys/bus/pci/devices')) -> int:
    """TPU chips on this host's PCI bus (Linux; 0 elsewhere)."""
    vendors = pci_devices.glob('*/vendor') if pci_devices.is_dir() else []
    return sum(1 for v in vendors if v.read_text().strip() == GOOGLE_PCI_VENDOR)


def skip_absent_tpu(environ: os._Environ | dict = os.environ) -> None:
    if 'JAX_PLATFORMS' in environ or importlib.util.find_spec('libtpu') is None or tpu_chips():
        return
    installed = [m.name for m in pkgutil.iter_modules()]
    gpus = [p for p in GPU_PLATFORMS if any(re.fullmatch(f'jax_{p}[0-9]*_plugin', name) for name in installed)]
    environ['JAX_PLATFORMS'] = ','.join([*gpus, 'cpu'])


def name_absent_tpu_host(accelerator_type: str, environ: os._Environ | dict = os.environ) -> None:
    """Before libtpu describes a slice on a host without TPU chips: names this host as the one worker
    of an `accelerator_type` slice (e.g. 'v5litepod-16'), which libtpu otherwise asks the TPU VM
    metadata for, printing `Failed to find host bounds` and `E0000 ... INVALID_ARGUMENT` lines
    when there is none. The slice's description does not depend on it. Values already set stand."""
    if tpu_chips():
        return
    environ.setdefault('TPU_ACCELERATOR_TYPE', accelerator_type)
    environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
    environ.setdefault('TPU_WORKER_ID', '0')


# XLA:CPU's instruction sets (the values of XLA_FLAGS=--xla_cpu_max_isa), oldest first, each with the
# /proc/cpuinfo flags it adds to the ones before it.
CPU_ISAS = (
    ('SSE4_2', ('sse4_2',)),
    ('AVX', ('avx',)),
    ('AVX2', ('avx2', 'fma')),
    ('AVX512', ('avx512f', 'avx512dq', 'avx512bw', 'avx512vl')),
    ('AVX512_VNNI', ('avx512_vnni',)),
    ('AVX512_BF16', ('avx512_bf16',)),
    ('AMX', ('amx_tile', 'amx_bf16', 'amx_int8')),
    ('AMX_FP16', ('amx_fp16',)),
)
ISA_NAMES = tuple(name for name, _ in CPU_ISAS)
NATIVE_BF16_DOT_ISAS = ('AVX512_BF16', 'AMX', 'AMX_FP16')  # bf16 x bf16 -> float32 dot instructions


@functools.cache
def host_cpu_isa(cpuinfo: Path = Path('/proc/cpuinfo')) -> str | None:
    """The newest of CPU_ISAS this host's CPU reports (its first processor's flags); None where it reports
    none of them (no /proc/cpuinfo, or not x86)."""
    text = cpuinfo.read_text() if cpuinfo.is_file() else ''
    line = next((line for line in text.splitlines() if line.startswith('flags')), '')
    flags, found = set(line.partition(':')[2].split()), None
    for name, needs in CPU_ISAS:
        if not flags.issuperset(needs):
            break
        found = name
    return found


def xla_max_isa(environ: os._Environ | dict = os.environ) -> str | None:
    """The ISA that XLA_FLAGS' --xla_cpu_max_isa limits XLA:CPU to, None if it is not set."""
    match = re.search(r'--xla_cpu_max_isa=(\w+)', environ.get('XLA_FLAGS', ''))
    return match and match.group(1).upper()


def cpu_isa(environ: os._Environ | dict = os.environ, cpuinfo: Path = Path('/proc/cpuinfo')) -> str | None:
    """The ISA XLA:CPU compiles for here: the host's, or the --xla_cpu_max_isa limit where that is older;
    None where the host reports none of CPU_ISAS."""
    host, limit = host_cpu_isa(cpuinfo), xla_max_isa(environ)
    if host is None or limit not in ISA_NAMES:
        return host
    return min(host, limit, key=ISA_NAMES.index)


def describe_cpu_isa(environ: os._Environ | dict = os.environ) -> str:
    """e.g. 'CPU ISA AVX2 (host AVX512_BF16, limited by --xla_cpu_max_isa=AVX2)'."""
    host, isa, limit = host_cpu_isa(), cpu_isa(environ), xla_max_isa(environ)
    return f'CPU ISA {isa or "unknown"}' + (f' (host {host}, limited by --xla_cpu_max_isa={limit})' if limit else '')


ONEDNN_FLAG = '--xla_cpu_experimental_onednn_custom_call'  # XLA:CPU matmuls (and convolutions) through oneDNN
ONEDNN_ISAS = ('AMX', 'AMX_FP16')  # where oneDNN's bf16 matmuls use AMX tiles and XLA's kernels do not
ONEDNN_ENV = 'VRL_CPU_ONEDNN'  # '1' or '0': on or off whatever the CPU


def onednn_choice(environ: os._Environ | dict = os.environ, cpuinfo: Path = Path('/proc/cpuinfo')) -> tuple[bool, str]:
    """(whether XLA:CPU runs its matmuls through oneDNN, why): as XLA_FLAGS sets ONEDNN_FLAG, else as
    VRL_CPU_ONEDNN says, else on for a CPU ISA of ONEDNN_ISAS."""
    given = re.search(rf'{ONEDNN_FLAG}=(\w+)', environ.get('XLA_FLAGS', ''))
    if given:
        return given.group(1).lower() in ('true', '1'), f'XLA_FLAGS sets {ONEDNN_FLAG}'
    if environ.get(ONEDNN_ENV) in ('0', '1'):
        return environ[ONEDNN_ENV] == '1', f'{ONEDNN_ENV}={environ[ONEDNN_ENV]}'
    isa = cpu_isa(environ, cpuinfo)
    if isa in ONEDNN_ISAS:
        return True, f'CPU ISA {isa}: oneDNN runs bf16 matmuls on its AMX tiles'
    return False, f"CPU ISA {isa or 'unknown'} has no AMX: XLA's own kernels"


def choose_cpu_options(environ: os._Environ | dict = os.environ, cpuinfo: Path = Path('/proc/cpuinfo')) -> None:
    """Adds ONEDNN_FLAG=true to XLA_FLAGS where `onednn_choice` is on and XLA_FLAGS does not name it
    (before jax starts its CPU client: XLA reads the flags once)."""
    on, _ = onednn_choice(environ, cpuinfo)
    if on and ONEDNN_FLAG not in environ.get('XLA_FLAGS', ''):
        environ['XLA_FLAGS'] = f'{environ.get("XLA_FLAGS", "")} {ONEDNN_FLAG}=true'.strip()


def cpu_matmul_path(environ: os._Environ | dict = os.environ, cpuinfo: Path = Path('/proc/cpuinfo')) -> str:
    """'onednn' or 'xla': whose kernels run this process's CPU matmuls (a peak is measured for each)."""
    return 'onednn' if onednn_choice(environ, cpuinfo)[0] else 'xla'
