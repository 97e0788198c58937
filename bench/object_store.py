"""Does a workdir on an object store slow the train step? The same run (configs/tiny.py, every step
logged) with its workdir on local disk and on a GCS emulator on 127.0.0.1, one after the other,
alternating, each for `--rounds`; prints the median step time of each (metrics.jsonl's
step_time, the first `--skip` steps left out: compiles and warm-up).

    python bench/object_store.py --steps=120 --rounds=2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gcs_emulator import bucket_fs, serving  # noqa: E402


def step_times(workdir: str, steps: int, env: dict[str, str], cwd: str) -> list[float]:
    subprocess.run([sys.executable, '-m', 'vrl.main', f'--config={ROOT / "configs/tiny.py"}', f'--workdir={workdir}',
                    f'--config.train.steps={steps}', '--config.train.log_every=1', '--config.train.eval_every=0',
                    '--config.train.eval_batches=1', f'--config.train.checkpoint_every={steps // 3}',
                    '--config.train.sample_prompt='], env=env, cwd=cwd, check=True, capture_output=True)
    if workdir.startswith('gs://'):
        text = bucket_fs().cat(workdir[5:] + '/metrics.jsonl').decode()
    else:
        text = (Path(workdir) / 'metrics.jsonl').read_text()
    return [r['step_time'] for r in map(json.loads, text.splitlines()) if 'step_time' in r]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=120)
    parser.add_argument('--skip', type=int, default=10)
    parser.add_argument('--rounds', type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, serving(f'{scratch}/objects'):
        env = {**os.environ, 'PYTHONPATH': str(ROOT)}
        times: dict[str, list[float]] = {'local': [], 'gs://': []}
        for round_ in range(args.rounds):
            for kind, workdir in (('local', f'{scratch}/local{round_}'), ('gs://', f'gs://vrl/run{round_}')):
                times[kind] += step_times(workdir, args.steps, env, scratch)[args.skip:]
    local = statistics.median(times['local'])
    print('| workdir | median step (ms) | steps | vs local |\n|---|---|---|---|')
    for kind, values in times.items():
        median = statistics.median(values)
        print(f'| {kind} | {1e3 * median:.1f} | {len(values)} | {median / local - 1:+.1%} |')


if __name__ == '__main__':
    main()
