"""What window shuffling costs in loss: the tiny config on the built-in Shakespeare corpus,
pre-tokenized, trained with the global per-document shuffle and with window shuffles, each for
several seeds (train.seed and data.seed together); the final eval loss over the whole validation
split, each shuffle's mean and spread, and its difference from the per-document shuffle's mean.

Windows are scaled to the run as the defaults are to the paper's: at 1,024 x 2,048 tokens a batch,
256K-token blocks are 1/8 of a batch and 64 blocks make a window of 8 batches; here a batch is
32 x 128 tokens, so blocks of 512 tokens, and windows of 64 blocks (the default) and of 8 (one
batch's worth, the smallest that keeps a batch from one window).

    python bench/shuffle_loss.py [--seeds=0,1,2] [--steps=400] [--windows=64,8] [--block_tokens=512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vrl.data import corpus, pipeline, tokens  # noqa: E402
from vrl.data.config import DataConfig  # noqa: E402


def final_eval_loss(workdir: Path) -> float:
    records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return [r['eval_loss'] for r in records if 'eval_loss' in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--seeds', default='0,1,2')
    parser.add_argument('--steps', type=int, default=400)
    parser.add_argument('--windows', default='64,8', help='data.window_blocks of the window rows')
    parser.add_argument('--block_tokens', type=int, default=512)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(',')]
    with tempfile.TemporaryDirectory() as scratch:
        data = DataConfig(name='shakespeare', data_dir=f'{scratch}/tfds')
        pipeline.build_built_ins(data)
        tokenizer = pipeline.load_tokenizer(data, 1024)
        tokens.tokenize('shakespeare', data.data_dir, tokenizer)
        rows = [('documents', '-', ['--config.data.shuffle=documents'])]
        rows += [
            (
                'windows',
                w,
                [
                    '--config.data.shuffle=windows',
                    f'--config.data.block_tokens={args.block_tokens}',
                    f'--config.data.window_blocks={w}',
                ],
            )
            for w in args.windows.split(',')
        ]
        results, started = {}, time.time()
        for label, window, overrides in rows:
            for seed in seeds:
                workdir = Path(scratch) / f'{label}-{window}-{seed}'
                subprocess.run(
                    [
                        sys.executable,
                        '-m',
                        'vrl.main',
                        '--config=configs/tiny.py',
                        f'--workdir={workdir}',
                        f'--config.data.data_dir={data.data_dir}',
                        f'--config.data.tokenizer={tokenizer.path}',
                        f'--config.train.seed={seed}',
                        f'--config.data.seed={seed}',
                        f'--config.train.steps={args.steps}',
                        f'--config.optimizer.decay_steps={args.steps}',
                        f'--config.train.eval_every={args.steps}',
                        '--config.train.eval_batches=0',
                        f'--config.train.checkpoint_every={args.steps}',
                        '--config.train.sample_tokens=0',
                        *overrides,
                    ],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                )
                results.setdefault((label, window), []).append(final_eval_loss(workdir))
                print(f'{label} {window} seed {seed}: {results[(label, window)][-1]:.4f}', file=sys.stderr, flush=True)
        train_documents = corpus.split_info('shakespeare', data.data_dir, 'train').documents
    base = statistics.mean(results[('documents', '-')])
    print(
        f'tiny config, {args.steps} steps of 32 x 128 tokens, Shakespeare ({train_documents:,} train documents), '
        f'seeds {args.seeds}; blocks of {args.block_tokens} tokens; {time.time() - started:.0f} s; load average '
        f'{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n'
    )
    print('| shuffle | window (blocks) | eval loss per seed | mean | spread (max - min) | mean - per-document mean |')
    print('|---|---|---|---|---|---|')
    for (label, window), losses in results.items():
        mean = statistics.mean(losses)
        print(
            f'| {label} | {window} | {", ".join(f"{x:.4f}" for x in losses)} | {mean:.4f} | '
            f'{max(losses) - min(losses):.4f} | {mean - base:+.4f} |'
        )


if __name__ == '__main__':
    main()
