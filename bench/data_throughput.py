"""Input-pipeline tokens/s on the embedded Shakespeare corpus, and the tokenizer's training time.

    python bench/data_throughput.py [--batches 200] [--seq_len 128] [--batch_size 32]

Compare with bench/train_throughput.py: the pipeline should feed >= 10x what a step consumes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vrl import corpus, data  # noqa: E402
from vrl.config import DataConfig  # noqa: E402
from vrl.tokenizer import train as train_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--batches', type=int, default=200)
    parser.add_argument('--seq_len', type=int, default=128)
    parser.add_argument('--batch_size', type=int, default=32)
    parser.add_argument('--vocab_size', type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        start = time.perf_counter()
        corpus.prepare(corpus.shakespeare_spec(), 'shakespeare', data_dir)
        build_seconds = time.perf_counter() - start
        start = time.perf_counter()
        tokenizer = train_tokenizer(corpus.texts(corpus.open_split('shakespeare', data_dir, 'train')),
                                    args.vocab_size, str(Path(data_dir) / 'tok.model'))
        tokenizer_seconds = time.perf_counter() - start
        print(f'TFDS build of the Shakespeare corpus: {build_seconds:.1f}s; '
              f'{args.vocab_size}-piece BPE tokenizer training: {tokenizer_seconds:.1f}s')
        print(f'{"workers":>7} | {"tokens/s":>10} | batches of {args.batch_size} x {args.seq_len}')
        for workers in (0, 1, 2):
            cfg = DataConfig(name='shakespeare', data_dir=data_dir, seq_len=args.seq_len,
                             batch_size=args.batch_size, num_workers=workers)
            iterator = iter(data.train_dataset(cfg, tokenizer))
            next(iterator)  # start-up (worker processes) is not throughput
            start = time.perf_counter()
            for _ in range(args.batches):
                next(iterator)
            seconds = time.perf_counter() - start
            getattr(iterator, 'close', lambda: None)()
            print(f'{workers:>7} | {args.batches * args.batch_size * args.seq_len / seconds:>10,.0f}')


if __name__ == '__main__':
    main()
