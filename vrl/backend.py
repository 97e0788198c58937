"""Which JAX platforms a vrl process starts: no TPU runtime where there is no TPU.

With libtpu installed (requirements-tpu.txt, for ahead-of-time TPU compiles) JAX also starts the
TPU runtime on machines without TPU chips; it fails, prints `Failed to find host bounds...` and
`E0000 ... INVALID_ARGUMENT` lines that read like errors, and JAX falls back to the other
platforms. `skip_absent_tpu`, called when `vrl` is imported, sets JAX_PLATFORMS to the platforms
that can start instead (GPU plugins that are installed, then CPU) when libtpu is installed, no
TPU chip is on the PCI bus and JAX_PLATFORMS is not set already. On a TPU VM nothing changes.
Describing a TPU slice for an ahead-of-time compile starts libtpu on purpose: `name_absent_tpu_host`
keeps that quiet too.
"""

from __future__ import annotations

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
