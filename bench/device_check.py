"""The first minutes on a lent GPU: what only an accelerator can measure, each part time-boxed, the
whole resumable part by part, written to one folder as a markdown table and a JSON file.

    bash bench/device_check.sh OUT          # on the GPU machine: the wheels installed, then this
    python bench/device_check.py --out OUT [--parts a,b] [--again] [--dry]

Parts (PARTS; each a command of its own, killed at its time box so that one slow part cannot eat
the rest): the GPU-only tests (cuDNN on whole sequences and on one device's part of a split
sequence, against the XLA path); what `auto` chooses for the 468M and its memory
(`vrl.main --compile_only`); the bf16 train step of vanilla, ResFormer and SVFormer at 2,048 tokens
for the 82M and the 468M (tokens/s, step time, peak memory, MFU against the chip's bf16 peak;
bench/train_throughput.py); decoding at 8K and 32K of context, vanilla against SVFormer
(bench/decode.py); the in-training downstream scoring's cost (bench/downstream_cost.py); SVFormer's
cache in vLLM on FlashAttention (bench/vllm_throughput.py --requests; only where vLLM's GPU build and
serving/vllm are installed, which the wheels a command carries cannot bring); and a 4-seed group's
step against one run's (bench/group_runs.py).

The parts' time boxes add up to under 8 minutes (BUDGET_S; a part that could end past it is left for
the next command). A part whose `<part>.json` in OUT, or in `--state` (a folder that outlives OUT:
the lent machine gives each command a new OUT), says it passed is not run again (`--again` runs it
anyway), so a second command after a timeout goes on where the first stopped. Every result names the device,
jax's version and the commit (DEVICE_COMMIT, written by bench/device_wheels.py beside the wheels;
the machine has no git history). `--dry` runs every part with tiny shapes on this CPU (the GPU tests
collected, not run: they skip on a CPU), as the suite does (tests/test_device_check.py), so that a
renamed flag or test fails here, not in the GPU window.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DRY_SECONDS = 300  # each part's time box in --dry mode, on a loaded 2-core CPU
BUDGET_S = 480  # the whole check: a lent machine's command runs 10 minutes at most, the install included


@dataclasses.dataclass(frozen=True)
class Part:
    """A command, its time box (s) on the GPU, its arguments in --dry mode instead of `args`, and
    the environment it adds on the GPU."""

    name: str
    what: str
    args: tuple[str, ...]
    seconds: int
    dry: tuple[str, ...]
    gpu_env: tuple[tuple[str, str], ...] = ()
    needs: str = ''  # a module the part imports that the wheels may not bring: without it the part is skipped
    elsewhere: str = ''  # an interpreter (from the repository root) that has `needs` when this one does not
    install: str = ''  # how to install `needs`, said when the part is skipped


PARTS = (
    Part(
        'gpu_tests',
        'cuDNN attention against the XLA path (whole sequences; one part of a split one)',
        ('-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'tests/test_attention.py', '-k', 'gpu'),
        75,
        ('-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'tests/test_attention.py', '-k', 'gpu', '--collect-only'),
        (('JAX_PLATFORMS', 'cuda'),),
    ),  # the suite's conftest picks the CPU unless told
    Part(
        'auto_468m',
        'what auto chooses for the 468M (attention, remat, microbatches) and its memory',
        ('-m', 'vrl.main', '--config=configs/svformer_468m.py', '--compile_only'),
        45,
        ('-m', 'vrl.main', '--config=configs/tiny.py:svformer', '--compile_only', '--config.data.batch_size=8'),
    ),
    Part(
        'train_82m',
        'bf16 train step, 82M at 2,048 tokens, 32 sequences',
        (
            'bench/train_throughput.py',
            '--configs',
            '82m',
            '--variants',
            'vanilla,resformer,svformer',
            '--seq_len',
            '2048',
            '--batch',
            '32',
            '--steps',
            '5',
            '--dtype',
            'bfloat16',
        ),
        80,
        (
            'bench/train_throughput.py',
            '--configs',
            'tiny',
            '--variants',
            'vanilla,svformer',
            '--seq_len',
            '64',
            '--batch',
            '2',
            '--steps',
            '2',
        ),
    ),
    Part(
        'train_468m',
        'bf16 train step, 468M at 2,048 tokens, 16 sequences (auto-fit picks remat)',
        (
            'bench/train_throughput.py',
            '--configs',
            '468m',
            '--variants',
            'vanilla,resformer,svformer',
            '--seq_len',
            '2048',
            '--batch',
            '16',
            '--steps',
            '5',
            '--dtype',
            'bfloat16',
        ),
        110,
        (
            'bench/train_throughput.py',
            '--configs',
            'tiny',
            '--variants',
            'resformer',
            '--seq_len',
            '64',
            '--batch',
            '2',
            '--steps',
            '2',
        ),
    ),
    Part(
        'decode',
        'decoding at 8K and 32K of context: tokens/s, cache bytes, share of the bandwidth bound',
        (
            'bench/decode.py',
            '--size',
            '82m',
            '--contexts',
            '8192,32768',
            '--batches',
            '1,8',
            '--variants',
            'vanilla,svformer',
        ),
        50,
        (
            'bench/decode.py',
            '--size',
            '82m',
            '--layers',
            '2',
            '--contexts',
            '64',
            '--batches',
            '1',
            '--new_tokens',
            '2',
            '--variants',
            'vanilla,svformer',
            '--probe_mib',
            '64',
        ),
    ),
    Part(
        'downstream',
        'in-training downstream scoring: its share of training time (goal <= 5%)',
        ('bench/downstream_cost.py', '--size', '82m'),
        50,
        (
            'bench/downstream_cost.py',
            '--size',
            '82m',
            '--layers',
            '2',
            '--limit',
            '2',
            '--rows',
            '2',
            '--train_rows',
            '1',
        ),
        needs='lm_eval',
        install='here: pip install -r requirements-extra.txt; on a lent machine: send device_wheels_eval/, '
        'made by `python bench/device_wheels.py --eval`',
    ),  # lm-eval and its dependencies are 45 MiB more wheels than a command carries
    Part(
        'vllm_svformer',
        "vLLM on FlashAttention: SVFormer's and SkipV1Former's caches (V_1 once) against vanilla's where it binds",
        ('bench/vllm_throughput.py', '--variants', 'vanilla,svformer,svformer+cla2,skipv1', '--requests', '96')
        + ('--prompt_tokens', '2048', '--new_tokens', '128', '--kv_cache_mib', '2048', '--dtype', 'bfloat16'),
        90,
        ('bench/vllm_throughput.py', '--size', '82m', '--variants', 'vanilla,svformer,skipv1', '--requests', '2')
        + ('--prompt_tokens', '64', '--new_tokens', '2', '--kv_cache_mib', '16'),
        needs='vllm',
        elsewhere='.venv/vllm/bin/python',
        install="here: bash serving/vllm/install; on a GPU machine: vllm of requirements-vllm.txt's release and "
        'pip install -e serving/vllm',
    ),  # vLLM's GPU build is not among the wheels a command carries: where it is installed
    Part(
        'group',
        "a 4-seed group's step against one run's (goal <= 2x)",
        ('bench/group_runs.py', '--seeds', '4', '--time_only'),
        50,
        ('bench/group_runs.py', '--seeds', '2', '--time_only', '--rounds', '1', '--layers', '2'),
    ),
)


def _device() -> dict[str, str]:
    """The device, jax's version and the commit, from a child process (this one imports no jax)."""
    probe = subprocess.run(
        [
            PY,
            '-c',
            'import jax; d = jax.devices(); print(jax.__version__); '
            'print(f"{len(d)} x {d[0].device_kind} ({jax.default_backend()})")',
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    lines = probe.stdout.split('\n') + ['?', '?']
    version, device = lines[:2] if probe.returncode == 0 else ('?', probe.stderr[-300:])
    commit_file = ROOT / 'device_wheels' / 'DEVICE_COMMIT'
    commit = os.environ.get('VRL_COMMIT') or (commit_file.read_text().strip() if commit_file.exists() else '')
    if not commit:
        git = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=ROOT)
        commit = git.stdout.strip() or 'unknown'
    return {'device': device.strip(), 'jax': version.strip(), 'commit': commit}


def run_part(part: Part, out: Path, dry: bool, env: dict[str, str]) -> dict:
    """Runs `part` within its time box; its output to OUT/<part>.log; returns its record."""
    args = part.dry if dry else part.args
    env = env if dry else {**env, **dict(part.gpu_env)}
    seconds = max(part.seconds, DRY_SECONDS) if dry else part.seconds  # a CPU compiles slower than its tiny shapes run
    started = time.monotonic()
    with open(out / f'{part.name}.log', 'w') as log:
        try:
            code = subprocess.run(
                [PY, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=seconds
            ).returncode
            status = 'passed' if code == 0 else f'failed (exit {code})'
        except subprocess.TimeoutExpired:
            status = f'timed out at {seconds} s'
    record = {
        'part': part.name,
        'what': part.what,
        'status': status,
        'seconds': round(time.monotonic() - started, 1),
        'command': ' '.join(['python', *args]),
        'output': (out / f'{part.name}.log').read_text()[-6000:],
    }
    return record


def passed_before(name: str, folders: list[Path]) -> dict | None:
    """The record of part `name` in the first of `folders` where it passed, if any."""
    for folder in folders:
        done = folder / f'{name}.json'
        if done.exists() and json.loads(done.read_text())['status'] == 'passed':
            return json.loads(done.read_text())
    return None


def report(out: Path, header: dict[str, str], records: list[dict]) -> str:
    """The markdown report: a line per part, then each part's output."""
    lines = [
        f'# Device check: {header["device"]}, jax {header["jax"]}, commit {header["commit"]}',
        '',
        '| part | what | status | seconds |',
        '|---|---|---|---|',
    ]
    lines += [f'| {r["part"]} | {r["what"]} | {r["status"]} | {r["seconds"]:.0f} |' for r in records]
    for r in records:
        lines += ['', f'## {r["part"]}: {r["status"]}', '', f'`{r["command"]}`', '', '```', r['output'].rstrip(), '```']
    text = '\n'.join(lines) + '\n'
    (out / 'device_check.md').write_text(text)
    (out / 'device_check.json').write_text(json.dumps({**header, 'parts': records}, indent=1))
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', required=True, help="where the report and each part's output go")
    parser.add_argument('--parts', default=','.join(p.name for p in PARTS))
    parser.add_argument('--again', action='store_true', help='run parts that passed before too')
    parser.add_argument('--dry', action='store_true', help='tiny shapes on this CPU (what the suite runs)')
    parser.add_argument('--budget_s', type=int, default=BUDGET_S, help='no part starts that could end past this')
    parser.add_argument('--state', help="a folder that keeps each part's record between commands (OUT's too)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    keep = [out] + ([Path(args.state).resolve()] if args.state else [])
    for folder in keep:
        folder.mkdir(parents=True, exist_ok=True)
    names = args.parts.split(',')
    unknown = sorted(set(names) - {p.name for p in PARTS})
    if unknown:
        sys.exit(f'error: --parts names {unknown}; allowed: {", ".join(p.name for p in PARTS)}')
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.dry:
        env['JAX_PLATFORMS'] = 'cpu'
    header = _device()
    records, started = [], time.monotonic()
    for part in (p for p in PARTS if p.name in names):
        before = None if args.again else passed_before(part.name, keep)
        if before:
            records.append(before)
            print(f'{part.name}: passed before, kept', flush=True)
            continue
        elsewhere = part.elsewhere and (ROOT / part.elsewhere).exists()
        if part.needs and importlib.util.find_spec(part.needs) is None and not elsewhere:
            print(f'{part.name}: skipped, {part.needs} is not installed', flush=True)
            records.append(
                {
                    'part': part.name,
                    'what': part.what,
                    'seconds': 0.0,
                    'command': '',
                    'output': '',
                    'status': f'skipped: needs {part.needs} ({part.install})',
                }
            )
            continue
        if not args.dry and time.monotonic() - started + part.seconds > args.budget_s:
            print(f'{part.name}: left for the next command (--budget_s {args.budget_s})', flush=True)
            records.append(
                {
                    'part': part.name,
                    'what': part.what,
                    'status': 'not run: left for the next command',
                    'seconds': 0.0,
                    'command': '',
                    'output': '',
                }
            )
            continue
        print(f'{part.name}: {part.what} (at most {part.seconds} s) ...', flush=True)
        records.append(run_part(part, out, args.dry, env))
        for folder in keep:
            (folder / f'{part.name}.json').write_text(json.dumps(records[-1], indent=1))
        print(f'{part.name}: {records[-1]["status"]} in {records[-1]["seconds"]:.0f} s', flush=True)
    report(out, header, records)
    print(f'wrote {out / "device_check.md"} and {out / "device_check.json"}')
    if any(r['status'] != 'passed' and not r['status'].startswith('skipped') for r in records):
        sys.exit(1)


if __name__ == '__main__':
    main()
