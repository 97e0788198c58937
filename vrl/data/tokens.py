"""Pre-tokenized datasets: every document of a prepared dataset as its token ids, tokenized once.

    python -m vrl.data tokenize --name=NAME --data_dir=DIR --tokenizer=PATH [--workers=N] [--overwrite]

The files (one folder per tokenizer beside the dataset, so several can coexist) are vrl/data/shards.py's.
`vrl.data prepare --tokenizer` writes them in the same pass as the text; `tokenize` makes them from a
prepared dataset's text, for another tokenizer or a TFDS catalog dataset.

Why flat shards mapped into memory rather than a record per document (ArrayRecord): a document is
then a slice of a mapped file, about a microsecond, where a record read is tens of microseconds;
at web documents' few hundred tokens either is fast, but short documents made records the
bottleneck (docs/data.md has the figures). Documents keep the dataset's indices, so the input
pipeline (vrl/data/pipeline.py) does on them exactly what it does on text: the same global shuffle,
process shares, packing, mixtures and checkpointed position; only the per-document map changes,
from tokenizing to a slice. Shards are written by a pool of processes, each moved into place when
whole (the offsets last), so a killed run resumes with the shards it had finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from vrl.core import multihost, storage
from vrl.data import corpus, pool, shards
from vrl.data.shards import MARKER, Shard, folder
from vrl.data.tokenizer import Tokenizer

# shards per split: a plan that does not depend on the worker count, so a resume with another finds it
DOCUMENTS_PER_SHARD = 100_000
MIN_SHARDS = 16


class TokenSource:
    """Random access to a split's documents as int32 token arrays, read in place from its shards
    (`shards.Shard`): nothing is copied whole. A block of consecutive documents costs one slice of each
    mapped file it spans on local disk, and two ranged reads on an object store (its offsets, then
    its tokens). Picklable (grain workers open their own)."""

    def __init__(self, shards: list[str], dtype: str, shard_documents: list[int], tokens: int):
        self._state = {'shards': shards, 'dtype': dtype, 'shard_documents': shard_documents, 'tokens': tokens}
        self._shards = [Shard(shard, np.dtype(dtype), n) for shard, n in zip(shards, shard_documents)]
        self._first = np.cumsum([0] + list(shard_documents))  # each shard's first document

    def __len__(self) -> int:
        return int(self._first[-1])

    @property
    def shard_documents(self) -> list[int]:
        """Each shard's documents, in order."""
        return list(self._state['shard_documents'])

    def token_count(self) -> float:
        """The split's tokens, as tokens.json records them."""
        return float(self._state['tokens'])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.documents(range(index, index + 1))[0]

    def documents(self, indices: range) -> list[np.ndarray]:
        """Documents indices.start..stop - 1 (consecutive), each as an int32 array: one read of the
        tokens of each shard they span, split (a read per document cost half the pipeline's time)."""
        out, start = [], indices.start
        while start < indices.stop:
            shard = int(np.searchsorted(self._first, start, side='right')) - 1
            first = int(self._first[shard])
            end = min(indices.stop, int(self._first[shard + 1]))
            offsets = self._shards[shard].offsets(start - first, end - first)
            span = self._shards[shard].tokens(int(offsets[0]), int(offsets[-1]))
            out += np.split(span, offsets[1:-1] - offsets[0])
            start = end
        return out

    def __getstate__(self) -> dict[str, Any]:
        return self._state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


def find(name: str, data_dir: str, split: str, tokenizer: Tokenizer, text_field: str = 'text') -> TokenSource | None:
    """The split of dataset `name` pre-tokenized by `tokenizer` from field `text_field`, read where
    it lies (local disk or an object store), or None when the dataset has no pre-tokenized copy at
    all (the log says so). DataError when its copies are all of other tokenizers (a config naming
    another tokenizer than meant, or one changed since), or when the copy was made from other text:
    another version of the dataset or another field."""
    dataset = corpus.dataset_path(name, data_dir)
    where = folder(dataset, tokenizer)
    make = f'python -m vrl.data tokenize --name={name} --data_dir={data_dir} --tokenizer={tokenizer.path}'
    if text_field != 'text':
        make += f' --text_field={text_field}'
    if not (where / MARKER).exists():
        others = sorted(str(marker.parent) for marker in (dataset / 'vrl_tokens').glob('*/' + MARKER))
        if others:
            raise corpus.DataError(
                f'dataset {name!r} is pre-tokenized only by other tokenizers than {tokenizer.path} '
                f'({", ".join(others)}; '
                f"each folder's tokens.json names its tokenizer). Pre-tokenize it by this one with `{make}`, name "
                'the tokenizer that made a copy in data.tokenizer, or tokenize on the fly: data.pretokenized=false.'
            )
        logging.info(
            '%s %s: tokenized on the fly by %s; pre-tokenize once with `%s`', name, split, tokenizer.path, make
        )
        return None
    info = json.loads((where / MARKER).read_text())
    if split not in info['splits']:
        return None
    entry = info['splits'][split]
    stale = _stale(
        info, entry, corpus.fingerprint(name, data_dir), corpus.split_info(name, data_dir, split).documents, text_field
    )
    if stale:
        raise corpus.DataError(
            f'{where} was made from other text than dataset {name!r} holds now ({stale}): make it '
            f'again with `{make} --overwrite`, or tokenize on the fly: data.pretokenized=false.'
        )
    logging.info(
        '%s %s: pre-tokenized by %s (%s documents, %s tokens) in %s',
        name,
        split,
        tokenizer.path,
        f'{entry["documents"]:,}',
        f'{entry["tokens"]:,}',
        where,
    )
    shards = [str(where / shard) for shard in entry['shards']]
    documents = entry.get('shard_documents') or _shard_documents(shards)
    _check_sizes(where, entry['shards'], np.dtype(info['dtype']), documents, entry['tokens'], make)
    return TokenSource(shards, info['dtype'], documents, entry['tokens'])


def _check_sizes(
    where: epath.Path, names: list[str], dtype: np.dtype, documents: list[int], total: int, make: str
) -> None:
    """DataError naming the first shard whose files are not the size their index says (a truncated or
    overwritten copy): its .offsets.npy holds documents + 1 int64 offsets after a header of a multiple
    of 64 bytes, and the split's .tokens files hold `total` tokens of `dtype`, each shard its last
    offset's worth. One listing; each shard's last offset is read only when the sum is off."""
    sizes = storage.files(where)
    fix = f'make it again with `{make} --overwrite`, or tokenize on the fly: data.pretokenized=false.'
    for name, n in zip(names, documents):
        offsets = sizes.get(f'{name}.offsets.npy', 0)
        header = offsets - 8 * (n + 1)
        if header <= 0 or header % 64:
            raise corpus.DataError(
                f'{where / name}.offsets.npy holds {offsets:,} bytes, not a header and the {n + 1:,} offsets '
                f'of its {n:,} documents: the pre-tokenized copy is damaged; {fix}'
            )
    if sum(sizes.get(f'{name}.tokens', 0) for name in names) == total * dtype.itemsize:
        return
    for name, n in zip(names, documents):
        expected = Shard(str(where / name), dtype, n).token_count() * dtype.itemsize
        if sizes.get(f'{name}.tokens', 0) != expected:
            raise corpus.DataError(
                f'{where / name}.tokens holds {sizes.get(f"{name}.tokens", 0):,} bytes, but its offsets end '
                f'at {expected // dtype.itemsize:,} {dtype.name} tokens ({expected:,} bytes): the pre-tokenized '
                f'copy is damaged (truncated or overwritten); {fix}'
            )
    raise corpus.DataError(
        f"{where}: the shards' tokens add up to another count than its {MARKER} records ({total:,}): {fix}"
    )


def _stale(info: dict, entry: dict, dataset_fingerprint: str, documents: int, text_field: str) -> str:
    """How a copy's tokens.json differs from the dataset and field it is read for; '' when it does
    not (a copy of format 1 records the document counts only)."""
    if entry['documents'] != documents:
        return f'{entry["documents"]} documents then, {documents} now'
    if info.get('dataset_fingerprint', dataset_fingerprint) != dataset_fingerprint:
        return 'the dataset was prepared again from other inputs since'
    if info.get('text_field', text_field) != text_field:
        return f'its text field was {info["text_field"]!r}, data.text_field is {text_field!r}'
    return ''


def _shard_documents(shards: list[str]) -> list[int]:
    """Each shard's document count from its offsets' header (a tokens.json that does not list them)."""
    return [shards.npy_header(f'{shard}.offsets.npy')[1] - 1 for shard in shards]


def tokenize(
    name: str,
    data_dir: str,
    tokenizer: Tokenizer,
    workers: int | None = None,
    overwrite: bool = False,
    text_field: str = 'text',
) -> epath.Path:
    """Writes every split of dataset `name` as `tokenizer`'s ids, in parallel on `workers`
    processes (default: all cores), each shard straight into the dataset's folder, local or on an
    object store (written locally, then moved or uploaded whole); resumes from the shards a killed
    run finished. Run on every host of a jax.distributed job, each host writes every
    process_count-th shard: process 0 first removes the old copy (`overwrite`), and writes
    tokens.json, which makes the folder complete, once every host is done. The shards do not
    depend on how many hosts or processes wrote them. Returns the folder."""
    dataset = corpus.dataset_path(name, data_dir)
    target = folder(dataset, tokenizer)
    multihost.on_process_0(lambda: _clear(target) if overwrite else None)
    if (target / MARKER).exists():
        logging.info('%s is already complete', target)
        return target
    dtype = shards.dtype_for(tokenizer.vocab_size)
    workers = workers or os.cpu_count() or 1
    finished = storage.files(target) if target.exists() else {}
    splits, tasks = {}, []
    for split in _splits(dataset):
        corpus.open_split(name, data_dir, split)  # on a store, its text copied down once, before the workers read it
        documents = corpus.split_info(name, data_dir, split).documents
        count = max(1, min(documents, max(MIN_SHARDS, math.ceil(documents / DOCUMENTS_PER_SHARD))))
        bounds = np.linspace(0, documents, count + 1).astype(int)
        names = [f'{split}-{i:05d}-of-{count:05d}' for i in range(count)]
        splits[split] = {'shards': names, 'documents': documents, 'shard_documents': np.diff(bounds).tolist()}
        tasks += [
            (
                name,
                data_dir,
                split,
                text_field,
                int(bounds[i]),
                int(bounds[i + 1]),
                str(target / shard),
                tokenizer,
                dtype.str,
            )
            for i, shard in enumerate(names)
        ]
    done = {k for k, task in enumerate(tasks) if f'{os.path.basename(task[6])}.offsets.npy' in finished}
    mine = [task for k, task in enumerate(tasks) if k % jax.process_count() == jax.process_index() and k not in done]
    logging.info(
        'tokenizing %s with %s: %d of %d shards to write here (%d done before), %d processes',
        name,
        tokenizer.path,
        len(mine),
        len(tasks),
        len(done),
        min(workers, max(len(mine), 1)),
    )
    start = time.perf_counter()
    if mine:
        target.mkdir(parents=True, exist_ok=True)
        for _ in pool.in_pool(_write_shard, mine, workers, 'tokenizing'):
            pass
    multihost.sync('vrl.data tokenize: every shard written')
    record = {'dataset_fingerprint': corpus.fingerprint(name, data_dir), 'text_field': text_field}
    multihost.on_process_0(
        lambda: shards.write_marker(target, name, tokenizer, _count_tokens(target, dtype, splits), record)
    )
    info = json.loads((target / MARKER).read_text())
    total = sum(entry['tokens'] for entry in info['splits'].values())
    seconds = time.perf_counter() - start
    logging.info(
        'tokenized %s: %s tokens in %.1fs (%s tokens/s) into %s',
        name,
        f'{total:,}',
        seconds,
        f'{total / max(seconds, 1e-9):,.0f}',
        target,
    )
    return target


def _clear(target: epath.Path) -> None:
    """Removes an old pre-tokenized copy (`--overwrite`), on local disk or the store."""
    if target.exists():
        target.rmtree()


def _count_tokens(target: epath.Path, dtype: np.dtype, splits: dict) -> dict:
    """`splits` with each split's tokens, read from its shards' last offsets (a small read each)."""
    for entry in splits.values():
        entry['tokens'] = sum(
            Shard(str(target / shard), dtype, n).token_count()
            for shard, n in zip(entry['shards'], entry['shard_documents'])
        )
    return splits


def _splits(dataset: epath.Path) -> list[str]:
    info = json.loads((dataset / 'dataset_info.json').read_text())
    return [split['name'] for split in info.get('splits', [])]


def _write_shard(task: tuple) -> int:
    """Documents [start, end) of a split as one shard (shards.ShardWriter)."""
    name, data_dir, split, text_field, start, end, path, tokenizer, dtype = task
    source = corpus.open_split(name, data_dir, split)
    writer = shards.ShardWriter(path, dtype)
    for first in range(start, end, shards.ENCODE_CHUNK):
        records = [source[i][text_field] for i in range(first, min(first + shards.ENCODE_CHUNK, end))]
        for ids in tokenizer.encode_batch([r.decode('utf-8') if isinstance(r, bytes) else r for r in records]):
            writer.write(ids)
    writer.close()
    return end - start
