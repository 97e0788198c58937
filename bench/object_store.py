"""Does a workdir on an object store slow the train step, and what does it send? The same run
(configs/tiny.py, every step logged, diagnostics every 10 steps, a checkpoint every `--steps / 8`)
with its workdir on local disk and on a GCS emulator on 127.0.0.1 behind tests/slow_store.py's
proxy (`--latency_ms` a request, `--mbps` per connection), one after the other, alternating, for
`--rounds`. Prints the median step time of each (metrics.jsonl's step_time, the first `--skip`
steps left out: compiles and warm-up) and, for the bucket, the bytes clients sent the store, less
the checkpoints', per logged step, beside what the run logged per step (its metrics.jsonl and
TensorBoard files).

    python bench/object_store.py --steps=400 --rounds=2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gcs_emulator import bucket_fs, environment, serving  # noqa: E402
from tests.slow_store import SlowStore  # noqa: E402
from vrl.core import storage  # noqa: E402
from vrl.train.trackers import stored  # noqa: E402


def step_times(workdir: str, steps: int, env: dict[str, str], cwd: str) -> list[float]:
    subprocess.run(
        [
            sys.executable,
            '-m',
            'vrl.main',
            f'--config={ROOT / "configs/tiny.py"}',
            f'--workdir={workdir}',
            f'--config.train.steps={steps}',
            '--config.train.log_every=1',
            '--config.train.eval_every=0',
            '--config.train.eval_batches=1',
            f'--config.train.checkpoint_every={steps // 8}',
            f'--config.train.keep_checkpoints={steps}',
            '--config.train.diagnostics_every=10',
            '--config.train.sample_tokens=0',
        ],
        env=env,
        cwd=cwd,
        check=True,
        capture_output=True,
    )
    return [r['step_time'] for r in stored.read_metrics(storage.path(workdir)) if 'step_time' in r]


def bytes_under(prefix: str) -> int:
    return sum(info['size'] for info in bucket_fs().find(prefix, detail=True).values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=400)
    parser.add_argument('--skip', type=int, default=10)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--latency_ms', type=float, default=30)
    parser.add_argument('--mbps', type=float, default=50)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as scratch,
        serving(f'{scratch}/objects') as url,
        SlowStore(url, args.latency_ms / 1e3, args.mbps * 1e6) as store,
    ):
        local_env = {**os.environ, 'PYTHONPATH': str(ROOT)}
        bucket_env = {**local_env, **environment(store.url)}
        times: dict[str, list[float]] = {'local': [], 'gs:// (slow store)': []}
        sent = logged = 0
        for round_ in range(args.rounds):
            times['local'] += step_times(f'{scratch}/local{round_}', args.steps, local_env, scratch)[args.skip :]
            before = store.bytes_received
            times['gs:// (slow store)'] += step_times(f'gs://vrl/run{round_}', args.steps, bucket_env, scratch)[
                args.skip :
            ]
            run = f'vrl/run{round_}'
            sent += store.bytes_received - before - bytes_under(f'{run}/checkpoints')
            logged += bytes_under(f'{run}/metrics.e1.jsonl') + bytes_under(f'{run}/tensorboard')
    local = statistics.median(times['local'])
    print(f'{args.steps} steps, latency {args.latency_ms:g} ms, {args.mbps:g} MB/s per connection\n')
    print('| workdir | median step (ms) | steps | vs local |\n|---|---|---|---|')
    for kind, values in times.items():
        median = statistics.median(values)
        print(f'| {kind} | {1e3 * median:.1f} | {len(values)} | {median / local - 1:+.1%} |')
    steps = args.rounds * args.steps
    print(
        f'\nsent to the store, less checkpoints: {sent / steps / 1e3:.1f} KB per logged step; '
        f'logged (metrics + TensorBoard): {logged / steps / 1e3:.1f} KB per step'
    )


if __name__ == '__main__':
    main()
