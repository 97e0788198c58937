"""Peak memory and speed of `vrl.data prepare` on large JSON lines input: its memory must not grow
with the input's size or its number of documents (it streams), and its speed grows with processes.

    python bench/prepare_memory.py [--sizes_mb 200,2000] [--compress zst] [--words 1000] [--files 1]
                                   [--workers 1,2]

Writes --files files of --words-word documents (words drawn from the embedded Shakespeare), each
size in all, in a temp folder, prepares them in a subprocess with each --workers, and reads the
largest process's peak RSS (ru_maxrss of the children).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vrl.data import corpus  # noqa: E402

# runs the command given after it and prints the peak RSS (KiB) of it and its children
PEAK = (
    'import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); '
    'print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)'
)


def write_jsonl(path: Path, megabytes: int, compress: str, words_per_document: int, seed: int = 0) -> tuple[int, int]:
    words = np.array(Path(corpus.shakespeare_spec().files[0]).read_text().split())
    rng = np.random.default_rng(seed)
    written = documents = 0
    raw = open(path, 'wb')
    out = raw
    if compress == 'zst':
        import zstandard

        out = zstandard.ZstdCompressor(level=3).stream_writer(raw)
    while written < megabytes << 20:
        block = ''.join(
            json.dumps({'text': ' '.join(rng.choice(words, words_per_document))}) + '\n' for _ in range(500)
        ).encode()
        out.write(block)
        written, documents = written + len(block), documents + 500
    out.close()
    return written, documents


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--sizes_mb', default='200,2000')
    parser.add_argument('--compress', default='', choices=('', 'zst'))
    parser.add_argument('--words', type=int, default=1000, help='words per document')
    parser.add_argument('--files', type=int, default=1, help='files the input is written as')
    parser.add_argument('--workers', default='1', help='prepare --workers values, comma-separated')
    args = parser.parse_args()
    print(
        '| JSON lines | files | documents | on disk | workers | prepare seconds | MB/s (uncompressed) | peak RSS |\n'
        '|---|---|---|---|---|---|---|---|'
    )
    for megabytes in map(int, args.sizes_mb.split(',')):
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / 'input').mkdir()
            size = documents = on_disk = 0
            for f in range(args.files):
                path = Path(folder) / 'input' / f'big{f}.jsonl{"." + args.compress if args.compress else ""}'
                written, count = write_jsonl(path, megabytes // args.files, args.compress, args.words, seed=f)
                size, documents, on_disk = size + written, documents + count, on_disk + path.stat().st_size
            for workers in map(int, args.workers.split(',')):
                start = time.perf_counter()
                measured = subprocess.run(
                    [
                        sys.executable,
                        '-c',
                        PEAK,
                        sys.executable,
                        '-m',
                        'vrl.data',
                        'prepare',
                        f'--input={folder}/input',
                        '--name=big',
                        f'--data_dir={folder}/tfds{workers}',
                        f'--workers={workers}',
                    ],
                    check=True,
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    env={**os.environ, 'PYTHONPATH': str(ROOT)},
                )
                seconds = time.perf_counter() - start
                peak = int(measured.stdout.split()[-1]) / 1024
                print(
                    f'| {size / 2**20:,.0f} MB | {args.files} | {documents:,} | {on_disk / 2**20:,.0f} MB | '
                    f'{workers} | '
                    f'{seconds:.0f} | {size / 2**20 / seconds:.1f} | {peak:,.0f} MB |',
                    flush=True,
                )


if __name__ == '__main__':
    main()
