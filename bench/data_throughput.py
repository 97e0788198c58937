"""Input-pipeline tokens/s per process: on-the-fly sentencepiece, on-the-fly `tokenizers`
(tokenizer.json) and the pre-tokenized reader, with 0/1/2 grain workers; and `vrl.data tokenize`
with 1 and 2 processes.

    python bench/data_throughput.py [--batches 30] [--seq_len 2048] [--batch_size 8]

Two corpora from the embedded Shakespeare: `speeches` (a document per blank-line block, ~65 tokens:
the worst case for per-document costs) and `pages` (the plays cut into ~4,000-character documents,
~1,000 tokens: the length of a web page in FineWeb or SlimPajama). docs/performance.md compares the
figures with what a TPU host consumes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vrl.data import build, corpus, pipeline, sources, tokens  # noqa: E402
from vrl.data.config import DataConfig  # noqa: E402
from vrl.data.tokenizer import train as train_tokenizer  # noqa: E402


def pages(folder: Path, chars: int = 4000) -> sources.CorpusSpec:
    """The plays as JSON lines of ~`chars`-character documents, cut at blank lines."""
    lines = []
    for file in corpus.shakespeare_spec().files:
        page = ''
        for block in re.split(r'\n[ \t\r]*\n', Path(file).read_text()):
            page += block + '\n\n'
            if len(page) >= chars:
                lines.append(json.dumps({'text': page}))
                page = ''
    (folder / 'pages.jsonl').write_text('\n'.join(lines) + '\n')
    return sources.CorpusSpec(files=(str(folder / 'pages.jsonl'),), validation_fraction=0.02)


def tokens_per_second(cfg: DataConfig, tokenizer, batches: int) -> float:
    iterator = iter(pipeline.train_dataset(cfg, tokenizer))
    next(iterator)  # start-up (worker processes) is not throughput
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - start
    getattr(iterator, 'close', lambda: None)()
    return batches * cfg.batch_size * cfg.seq_len / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--batches', type=int, default=30)
    parser.add_argument('--seq_len', type=int, default=2048)
    parser.add_argument('--batch_size', type=int, default=8)
    parser.add_argument('--vocab_size', type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build.prepare(corpus.shakespeare_spec(), 'speeches', folder)
        build.prepare(pages(Path(folder)), 'pages', folder)
        texts = list(corpus.texts(corpus.open_split('pages', folder, 'train')))
        kinds = {
            'sentencepiece': train_tokenizer(texts, args.vocab_size, f'{folder}/sp.model'),
            'tokenizers': train_tokenizer(texts, args.vocab_size, f'{folder}/tokenizer.json'),
        }
        print('| corpus | tokenize processes | seconds | tokens/s |\n|---|---|---|---|')
        for name in ('speeches', 'pages'):
            for workers in (1, 2):
                start = time.perf_counter()
                target = tokens.tokenize(name, folder, kinds['tokenizers'], workers=workers, overwrite=True)
                seconds = time.perf_counter() - start
                total = sum(s['tokens'] for s in json.loads((target / tokens.MARKER).read_text())['splits'].values())
                print(f'| {name} | {workers} | {seconds:.1f} | {total / seconds:,.0f} |')
        print(
            f'\n| corpus | tokens/document | pipeline | workers | tokens/s (batches of {args.batch_size} x '
            f'{args.seq_len}) |\n|---|---|---|---|---|'
        )
        for name in ('speeches', 'pages'):
            info = json.loads(
                (tokens.folder(corpus.dataset_path(name, folder), kinds['tokenizers']) / tokens.MARKER).read_text()
            )['splits']['train']
            per_document = info['tokens'] / info['documents']
            for pipeline, tokenizer, pretokenized in (
                ('on the fly, sentencepiece', kinds['sentencepiece'], False),
                ('on the fly, tokenizers', kinds['tokenizers'], False),
                ('pre-tokenized', kinds['tokenizers'], True),
            ):
                for workers in (0, 1, 2):
                    cfg = DataConfig(
                        name=name,
                        data_dir=folder,
                        seq_len=args.seq_len,
                        batch_size=args.batch_size,
                        num_workers=workers,
                        pretokenized=pretokenized,
                    )
                    rate = tokens_per_second(cfg, tokenizer, args.batches)
                    print(f'| {name} | {per_document:,.0f} | {pipeline} | {workers} | {rate:,.0f} |', flush=True)


if __name__ == '__main__':
    main()
