"""Pre-tokenized datasets: every document of a prepared dataset as its token ids, tokenized once.

    python -m vrl.data tokenize --name=NAME --data_dir=DIR --tokenizer=PATH [--workers=N] [--overwrite]

Layout, beside the TFDS dataset it was made from (one folder per tokenizer, so several can coexist):

    DATA_DIR/NAME/VERSION/vrl_tokens/<tokenizer fingerprint>/
        train-00000-of-00008.tokens        the shard's documents' ids one after another, in the
                                           dataset's record order, little-endian uint16
                                           (vocabularies up to 65,536) or uint32
        train-00000-of-00008.offsets.npy   int64: where each document starts, and the end
        ...
        tokens.json                        written last, what makes the folder complete: the
                                           tokenizer, the dtype, and per split its shards and
                                           document and token counts

Why flat shards mapped into memory rather than a record per document (ArrayRecord): a document is
then a slice of a mapped file, about a microsecond, where a record read is tens of microseconds;
at web documents' few hundred tokens either is fast, but short documents made records the
bottleneck (docs/data.md has the figures). Documents keep the dataset's indices, so the input
pipeline (vrl/data/pipeline.py) does on them exactly what it does on text: the same global shuffle,
process shares, packing, mixtures and checkpointed position; only the per-document map changes,
from tokenizing to a slice. Shards are written by a pool of processes, each to `.partial` files
renamed when whole (the offsets last), so a killed run resumes with the shards it had finished.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import time
from typing import Any

import numpy as np
from etils import epath

from vrl.core import storage
from vrl.data import corpus
from vrl.data.tokenizer import Tokenizer

MARKER = 'tokens.json'
FORMAT = 1
# shards per split: a plan that does not depend on the worker count, so a resume with another finds it
DOCUMENTS_PER_SHARD = 100_000
MIN_SHARDS = 16
ENCODE_CHUNK = 256  # documents per encode_batch call


def folder(dataset_path: epath.Path, tokenizer: Tokenizer) -> epath.Path:
    """Where dataset folder `dataset_path` (NAME/VERSION) keeps `tokenizer`'s tokens."""
    return dataset_path / 'vrl_tokens' / tokenizer.fingerprint


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype('<u2') if vocab_size <= 1 << 16 else np.dtype('<u4')


class TokenSource:
    """Random access to a split's documents as int32 token arrays, over its shards' files mapped
    into memory: a document is a slice, no copy until the cast. Picklable (grain workers map their
    own)."""

    def __init__(self, shards: list[str], dtype: str):
        self._shards, self._dtype = shards, dtype
        self._tokens = [np.memmap(f'{shard}.tokens', dtype, 'r') if os.path.getsize(f'{shard}.tokens') else
                        np.zeros(0, dtype) for shard in shards]
        self._offsets = [np.load(f'{shard}.offsets.npy') for shard in shards]
        self._first = np.cumsum([0] + [len(o) - 1 for o in self._offsets])  # each shard's first document

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.documents(range(index, index + 1))[0]

    def documents(self, indices: range) -> list[np.ndarray]:
        """Documents indices.start..stop - 1 (consecutive), each as an int32 array: one slice and one
        cast per shard they span (a memmap slice per document cost half the pipeline's time)."""
        out, start = [], indices.start
        while start < indices.stop:
            shard = int(np.searchsorted(self._first, start, side='right')) - 1
            first = int(self._first[shard])
            end = min(indices.stop, int(self._first[shard + 1]))
            offsets = self._offsets[shard][start - first:end - first + 1]
            span = np.asarray(self._tokens[shard][offsets[0]:offsets[-1]]).astype(np.int32)
            out += np.split(span, offsets[1:-1] - offsets[0])
            start = end
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {'shards': self._shards, 'dtype': self._dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state['shards'], state['dtype'])


def find(name: str, data_dir: str, split: str, tokenizer: Tokenizer) -> TokenSource | None:
    """The split of dataset `name` pre-tokenized by `tokenizer`, or None when the dataset has no
    pre-tokenized copy at all (the log says so). DataError when its copies are all of other
    tokenizers (a config naming another tokenizer than meant, or one changed since), or when the
    copy does not match the dataset."""
    dataset = corpus.dataset_path(name, data_dir)
    remote = folder(dataset, tokenizer)
    make = f'python -m vrl.data tokenize --name={name} --data_dir={data_dir} --tokenizer={tokenizer.path}'
    if not (remote / MARKER).exists():
        others = sorted(str(marker.parent) for marker in (dataset / 'vrl_tokens').glob('*/' + MARKER))
        if others:
            raise corpus.DataError(
                f'dataset {name!r} is pre-tokenized only by other tokenizers than {tokenizer.path} ({", ".join(others)}; '
                f'each folder\'s tokens.json names its tokenizer). Pre-tokenize it by this one with `{make}`, name '
                'the tokenizer that made a copy in data.tokenizer, or tokenize on the fly: data.pretokenized=false.')
        logging.info('%s %s: tokenized on the fly by %s; pre-tokenize once with `%s`', name, split, tokenizer.path, make)
        return None
    local = storage.local_copy(remote)
    info = json.loads((local / MARKER).read_text())
    if split not in info['splits']:
        return None
    expected = len(corpus.open_split(name, data_dir, split))
    entry = info['splits'][split]
    if entry['documents'] != expected:
        raise corpus.DataError(
            f'{remote} holds {entry["documents"]} {split} documents but dataset {name!r} has {expected}: it was '
            f'made from another version of the dataset. Make it again: `{make} --overwrite`.')
    logging.info('%s %s: pre-tokenized by %s (%s documents, %s tokens) in %s', name, split, tokenizer.path,
                 f'{entry["documents"]:,}', f'{entry["tokens"]:,}', remote)
    return TokenSource([str(local / shard) for shard in entry['shards']], info['dtype'])


def tokenize(name: str, data_dir: str, tokenizer: Tokenizer, workers: int | None = None,
             overwrite: bool = False, text_field: str = 'text') -> epath.Path:
    """Writes every split of dataset `name` as `tokenizer`'s ids, in parallel on `workers`
    processes (default: all cores); resumes from the shards a killed run finished. Returns the
    folder. On an object store it is written in the local mirror and copied up, tokens.json last."""
    dataset = corpus.dataset_path(name, data_dir)
    target = folder(dataset, tokenizer)
    if (target / MARKER).exists() and not overwrite:
        logging.info('%s is already complete', target)
        return target
    local = storage.scratch(target) if storage.is_remote(target) else target
    if overwrite:
        storage.delete(target / MARKER)  # incomplete from here until the new one is written last
        if local.exists():
            local.rmtree()
    local.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for(tokenizer.vocab_size)
    workers = workers or os.cpu_count() or 1
    splits, tasks = {}, []
    for split in _splits(dataset):
        documents = len(corpus.open_split(name, data_dir, split))
        count = max(1, min(documents, max(MIN_SHARDS, math.ceil(documents / DOCUMENTS_PER_SHARD))))
        bounds = np.linspace(0, documents, count + 1).astype(int)
        shards = [f'{split}-{i:05d}-of-{count:05d}' for i in range(count)]
        splits[split] = {'shards': shards, 'documents': documents}
        tasks += [(name, data_dir, split, text_field, int(bounds[i]), int(bounds[i + 1]), str(local / shard),
                   tokenizer, dtype.str) for i, shard in enumerate(shards)
                  if not (local / f'{shard}.offsets.npy').exists()]
    done = sum(len(s['shards']) for s in splits.values()) - len(tasks)
    logging.info('tokenizing %s with %s: %d shards to write (%d done before), %d processes', name, tokenizer.path,
                 len(tasks), done, min(workers, max(len(tasks), 1)))
    start = time.perf_counter()
    if tasks:
        with multiprocessing.get_context('spawn').Pool(min(workers, len(tasks)), initializer=_one_thread) as pool:
            import tqdm
            for _ in tqdm.tqdm(pool.imap_unordered(_write_shard, tasks), total=len(tasks), unit='shard',
                               desc='tokenizing', disable=None):
                pass
    for entry in splits.values():
        entry['tokens'] = sum(int(np.load(local / f'{shard}.offsets.npy')[-1]) for shard in entry['shards'])
    info = {'format': FORMAT, 'dataset': name, 'tokenizer': tokenizer.path, 'fingerprint': tokenizer.fingerprint,
            'vocab_size': tokenizer.vocab_size, 'dtype': dtype.str, 'splits': splits}
    tokens = sum(entry['tokens'] for entry in splits.values())
    storage.write_bytes(local / MARKER, json.dumps(info, indent=2).encode())
    if local != target:
        storage.copy_tree(local, target, last=(MARKER,))
    seconds = time.perf_counter() - start
    logging.info('tokenized %s: %s tokens in %.1fs (%s tokens/s) into %s', name, f'{tokens:,}', seconds,
                 f'{tokens / max(seconds, 1e-9):,.0f}', target)
    return target


def _splits(dataset: epath.Path) -> list[str]:
    info = json.loads((dataset / 'dataset_info.json').read_text())
    return [split['name'] for split in info.get('splits', [])]


def _one_thread() -> None:
    """Each pool process encodes on one core: the processes are the parallelism."""
    os.environ['TOKENIZERS_PARALLELISM'] = 'false'


def _write_shard(task: tuple) -> int:
    """Documents [start, end) of a split as one shard: SHARD.tokens, their ids one after another,
    and SHARD.offsets.npy, where each document starts (and the end), written last: a shard whose
    offsets are there is whole."""
    name, data_dir, split, text_field, start, end, path, tokenizer, dtype = task
    source = corpus.open_split(name, data_dir, split)
    lengths = []
    with open(f'{path}.tokens.partial', 'wb') as out:
        for first in range(start, end, ENCODE_CHUNK):
            records = [source[i][text_field] for i in range(first, min(first + ENCODE_CHUNK, end))]
            texts = [r.decode('utf-8') if isinstance(r, bytes) else r for r in records]
            for ids in tokenizer.encode_batch(texts):
                out.write(ids.astype(dtype).tobytes())
                lengths.append(len(ids))
    os.replace(f'{path}.tokens.partial', f'{path}.tokens')
    with open(f'{path}.offsets.partial', 'wb') as out:
        np.save(out, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))
    os.replace(f'{path}.offsets.partial', f'{path}.offsets.npy')
    return end - start
