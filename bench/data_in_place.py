"""Can a host be fed from a bucket? The pre-tokenized reader (vrl/data/tokens.py) reading token
shards in place from a GCS emulator behind a slow-store proxy (tests/slow_store.py, its own
process: by default 50 ms a request, 50 MB/s a connection), at the 82M config's per-host batch
(8 x 2,048), against the same files on local disk, in each shuffle (data.shuffle: `documents`,
grain's threads reading small blocks; `windows`, whole I/O blocks of data.block_tokens).

The dataset is synthetic web pages (lognormal lengths, median ~700 tokens, random ids in a
32,768-piece vocabulary) written in vrl's pre-tokenized layout, --tokens in all. Prints a table:
time to the first batch, tokens/s after --warmup batches, the median and largest wait for a batch
after warm-up, the share of batches that waited over 1 ms, ranged reads (GETs) per million
tokens, and the reader's CPU seconds per million tokens; and the load average it ran under.
--faults adds a row through a store that answers one 503 and resets one connection on the
token reads.

With --step_ms the consumer stands for a training step: it holds each batch that long (the host idle
while the accelerator computes, as on a TPU host) before asking for the next, and the table says how
long it then waited for data: once warm, a reader that keeps up makes no step wait.

    python bench/data_in_place.py [--tokens=50000000] [--latency_ms=50] [--mbps=50]
                                  [--modes=documents:8,documents:64,windows:8] [--step_ms=0] [--faults]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gcs_emulator import PINNED, serving  # noqa: E402

os.environ.update(PINNED)  # before gcsfs is imported: it reads some (no bucket-type probe over gRPC) then
from vrl.core import storage  # noqa: E402
from vrl.data import pipeline, shards, tokens  # noqa: E402
from vrl.data.config import DataConfig  # noqa: E402
from vrl.data.tokenizer import Tokenizer, train  # noqa: E402

VOCAB = 32_768
SHARDS = 16


def write_dataset(data_dir: Path, tokenizer: Tokenizer, total_tokens: int, seed: int = 0) -> None:
    """A one-split dataset `pages` of synthetic documents, as `vrl.data prepare` + `tokenize` lay it out."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total_tokens:
        lengths += np.clip(rng.lognormal(6.5, 0.9, 10_000), 20, 20_000).astype(int).tolist()
    lengths = np.array(lengths)[: np.searchsorted(np.cumsum(lengths), total_tokens) + 1]
    version = data_dir / 'pages' / '1.0.0'
    folder = tokens.folder(storage.path(str(version)), tokenizer)
    folder.mkdir(parents=True)
    bounds = np.linspace(0, len(lengths), SHARDS + 1).astype(int)
    names = [f'train-{i:05d}-of-{SHARDS:05d}' for i in range(SHARDS)]
    for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
        shard_lengths = lengths[lo:hi]
        rng.integers(3, VOCAB, int(shard_lengths.sum()), dtype=np.uint16).tofile(folder / f'{name}.tokens')
        np.save(folder / f'{name}.offsets.npy', np.concatenate([[0], np.cumsum(shard_lengths)]).astype(np.int64))
    splits = {
        'train': {
            'shards': names,
            'documents': len(lengths),
            'shard_documents': np.diff(bounds).tolist(),
            'tokens': int(lengths.sum()),
        }
    }
    (folder / tokens.MARKER).write_text(
        json.dumps(
            {
                'format': shards.FORMAT,
                'dataset': 'pages',
                'fingerprint': tokenizer.fingerprint,
                'dtype': '<u2',
                'splits': splits,
            }
        )
    )
    # what TFDS records of the text: ~4 bytes a token
    (version / 'dataset_info.json').write_text(
        json.dumps(
            {
                'name': 'pages',
                'splits': [
                    {'name': 'train', 'numBytes': str(4 * int(lengths.sum())), 'shardLengths': [str(len(lengths))]}
                ],
            }
        )
    )


READS = [0]  # ranged reads (GETs on a store) so far


def _counting(read_range):
    def counted(url: str, start: int, end: int) -> bytes:
        READS[0] += 1
        return read_range(url, start, end)

    return counted


storage.read_range = _counting(storage.read_range)


def measure(cfg: DataConfig, tokenizer: Tokenizer, batches: int, warmup: int, step_s: float = 0.0) -> dict[str, float]:
    shards._HELD = shards._HeldOffsets(shards.OFFSETS_HELD_BYTES)  # each row reads the offsets it needs itself
    start, reads = time.perf_counter(), READS[0]
    iterator = iter(pipeline.train_dataset(cfg, tokenizer))
    next(iterator)
    first = time.perf_counter() - start
    for _ in range(warmup):
        next(iterator)
    waits, cpu, wall = [], time.process_time(), time.perf_counter()
    for _ in range(batches):
        time.sleep(step_s)
        before = time.perf_counter()
        next(iterator)
        waits.append(time.perf_counter() - before)
    seconds, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = batches * cfg.batch_size * cfg.seq_len
    taken = (batches + warmup + 1) * cfg.batch_size * cfg.seq_len
    row = {
        'first': first,
        'tokens/s': n / seconds,
        'median wait': statistics.median(waits),
        'max wait': max(waits),
        'waited': sum(w > 1e-3 for w in waits) / len(waits),
        'cpu per M': cpu / n * 1e6,
        'reads per M': (READS[0] - reads) / taken * 1e6,
    }
    getattr(iterator, 'close', lambda: None)()
    return row


def _proxy(url: str, args: argparse.Namespace, faults: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    proxy = subprocess.Popen(
        [
            sys.executable,
            '-m',
            'tests.slow_store',
            f'--upstream={url}',
            f'--latency_ms={args.latency_ms}',
            f'--mbps={args.mbps}',
            *[f'--fault={fault}' for fault in faults],
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proxy, proxy.stdout.readline().split("'")[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--tokens', type=int, default=50_000_000)
    parser.add_argument('--latency_ms', type=float, default=50)
    parser.add_argument('--mbps', type=float, default=50)
    parser.add_argument(
        '--modes',
        default='documents:8,documents:64,windows:8',
        help='SHUFFLE:READ_THREADS rows through the store, comma-separated',
    )
    parser.add_argument('--block_tokens', type=int, default=0, help='data.block_tokens of the windows rows')
    parser.add_argument('--window_blocks', type=int, default=64)
    parser.add_argument('--batches', type=int, default=150)
    parser.add_argument('--warmup', type=int, default=30)
    parser.add_argument('--step_ms', type=float, default=0, help='the time a training step holds each batch')
    parser.add_argument(
        '--faults',
        action='store_true',
        help='a windows row through a store that answers a 503 and resets a connection on token reads',
    )
    args = parser.parse_args()
    import gcsfs

    with tempfile.TemporaryDirectory() as scratch, serving(f'{scratch}/objects') as url:
        texts = [f'document {i}: ' + 'the quick brown fox jumps over the lazy dog ' * (i % 7 + 1) for i in range(2000)]
        tokenizer = train(texts, 300, f'{scratch}/tokenizer.json')
        local = Path(scratch) / 'tfds'
        write_dataset(local, tokenizer, args.tokens)
        storage.copy_tree(storage.path(str(local)), storage.path('gs://vrl/tfds'))
        size = sum(f.stat().st_size for f in local.rglob('*.tokens'))
        base = DataConfig(
            name='pages',
            data_dir=str(local),
            tokenizer=tokenizer.path,
            seq_len=2048,
            batch_size=8,
            block_tokens=args.block_tokens,
            window_blocks=args.window_blocks,
        )
        step_s = args.step_ms / 1e3
        rows = [('local disk', 'documents', 0, measure(base, tokenizer, args.batches, args.warmup, step_s))]
        runs = [(mode, int(threads), ()) for mode, threads in (m.split(':') for m in args.modes.split(','))]
        if args.faults:
            runs.append(('windows', 8, ('503:1:tokens', 'reset:1:tokens')))
        for mode, threads, faults in runs:
            proxy, slow_url = _proxy(url, args, faults)
            os.environ['STORAGE_EMULATOR_HOST'] = slow_url
            gcsfs.GCSFileSystem.clear_instance_cache()
            cfg = dataclasses.replace(base, data_dir='gs://vrl/tfds', read_threads=threads, shuffle=mode)
            store = f'gs:// via {args.latency_ms:g} ms, {args.mbps:g} MB/s' + (', a 503 and a reset' if faults else '')
            rows.append((store, mode, threads, measure(cfg, tokenizer, args.batches, args.warmup, step_s)))
            proxy.terminate()
    print(
        f'dataset: {args.tokens / 1e6:.0f}M tokens ({size / 1e6:.0f} MB uint16) in {SHARDS} shards; batch 8 x 2048; '
        f'a step holds each batch {args.step_ms:g} ms; windows of {args.window_blocks} blocks '
        f'(block_tokens {args.block_tokens or "auto"}); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} '
        'cores\n'
    )
    print(
        '| store | shuffle | read threads | first batch (s) | tokens/s | median wait (ms) | max wait (ms) | '
        'batches waited > 1 ms | GETs / M tokens | reader CPU s / M tokens |'
    )
    print('|---|---|---|---|---|---|---|---|---|---|')
    for store, mode, threads, r in rows:
        print(
            f'| {store} | {mode} | {threads} | {r["first"]:.2f} | {r["tokens/s"] / 1e6:.2f}M | '
            f'{1e3 * r["median wait"]:.1f} | {1e3 * r["max wait"]:.0f} | {100 * r["waited"]:.0f}% | '
            f'{r["reads per M"]:,.0f} | {r["cpu per M"]:.2f} |'
        )


if __name__ == '__main__':
    main()
