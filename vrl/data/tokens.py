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

import collections
import json
import logging
import math
import multiprocessing
import os
import tempfile
import threading
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from vrl.core import multihost, storage
from vrl.data import corpus
from vrl.data.tokenizer import Tokenizer

MARKER = 'tokens.json'
FORMAT = 2  # 2: tokens.json records the dataset's fingerprint, the text field and each shard's documents
# shards per split: a plan that does not depend on the worker count, so a resume with another finds it
DOCUMENTS_PER_SHARD = 100_000
MIN_SHARDS = 16
ENCODE_CHUNK = 256  # documents per encode_batch call


def folder(dataset_path: epath.Path, tokenizer: Tokenizer) -> epath.Path:
    """Where dataset folder `dataset_path` (NAME/VERSION) keeps `tokenizer`'s tokens."""
    return dataset_path / 'vrl_tokens' / tokenizer.fingerprint


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype('<u2') if vocab_size <= 1 << 16 else np.dtype('<u4')


OFFSETS_HELD_BYTES = 256 << 20  # per process: remote shards' offsets kept in memory (a 100,000-document shard: 0.8 MB)


class _HeldOffsets:
    """Whole shards' offsets read from an object store, least recently used dropped past `limit`
    bytes: with them a block is one ranged read (its tokens) instead of two. Thread-safe."""

    def __init__(self, limit: int):
        self._limit, self._bytes = limit, 0
        self._held: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
            return self._held.get(key)

    def put(self, key: str, offsets: np.ndarray) -> np.ndarray:
        with self._lock:
            if key not in self._held:
                self._held[key] = offsets
                self._bytes += offsets.nbytes
            while self._bytes > self._limit:
                self._bytes -= self._held.popitem(last=False)[1].nbytes
        return offsets


_HELD = _HeldOffsets(OFFSETS_HELD_BYTES)


class _Shard:
    """One shard's offsets and tokens, read in place: slices of memory-mapped files on local disk;
    on an object store ranged reads, the offsets of a whole shard at once (then held in memory,
    `_HELD`) where it is at most 1/16 of OFFSETS_HELD_BYTES."""

    def __init__(self, path: str, dtype: np.dtype, documents: int):
        self._path, self._dtype, self._documents, self._remote = path, dtype, documents, storage.is_remote(path)
        self._offsets: np.ndarray | None = None
        self._tokens: np.ndarray | None = None
        self._header = 0  # remote: where the offsets' data starts in the .npy file

    def offsets(self, first: int, last: int) -> np.ndarray:
        """int64 offsets[first..last], inclusive: where documents first..last - 1 start, and the end."""
        if not self._remote:
            if self._offsets is None:
                self._offsets = np.load(f'{self._path}.offsets.npy', mmap_mode='r')
            return np.asarray(self._offsets[first:last + 1])
        if 8 * self._documents > OFFSETS_HELD_BYTES // 16:
            return self._read_offsets(first, last)
        whole = _HELD.get(self._path)
        if whole is None:
            whole = _HELD.put(self._path, self._read_offsets(0, self._documents))
        return whole[first:last + 1]

    def _read_offsets(self, first: int, last: int) -> np.ndarray:
        if not self._header:
            self._header, _ = _npy_header(f'{self._path}.offsets.npy')
        data = storage.read_range(f'{self._path}.offsets.npy', self._header + 8 * first, self._header + 8 * (last + 1))
        return np.frombuffer(data, '<i8')

    def token_count(self) -> int:
        """The shard's tokens: its last offset, one small read."""
        return int(self._read_offsets(self._documents, self._documents)[0])

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of the shard, as int32."""
        if end <= start:
            return np.zeros(0, np.int32)
        if not self._remote:
            if self._tokens is None:
                self._tokens = np.memmap(f'{self._path}.tokens', self._dtype, 'r')
            return self._tokens[start:end].astype(np.int32)
        size = self._dtype.itemsize
        return np.frombuffer(storage.read_range(f'{self._path}.tokens', size * start, size * end),
                             self._dtype).astype(np.int32)


def _npy_header(url: str) -> tuple[int, int]:
    """(where the data starts, the length) of 1-D .npy file `url`, from its first bytes."""
    import io
    for size in (256, 1 << 16):  # np.save's header of a 1-D array is 128 bytes
        head = io.BytesIO(storage.read_range(url, 0, size))
        version = np.lib.format.read_magic(head)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        try:
            shape, _, _ = read(head)
        except ValueError:  # cut short
            continue
        return head.tell(), shape[0]
    raise corpus.DataError(f'{url} is not a .npy file of offsets: make the pre-tokenized copy again (--overwrite)')


class TokenSource:
    """Random access to a split's documents as int32 token arrays, read in place from its shards
    (`_Shard`): nothing is copied whole. A block of consecutive documents costs one slice of each
    mapped file it spans on local disk, and two ranged reads on an object store (its offsets, then
    its tokens). Picklable (grain workers open their own)."""

    def __init__(self, shards: list[str], dtype: str, shard_documents: list[int], tokens: int):
        self._state = {'shards': shards, 'dtype': dtype, 'shard_documents': shard_documents, 'tokens': tokens}
        self._shards = [_Shard(shard, np.dtype(dtype), n) for shard, n in zip(shards, shard_documents)]
        self._first = np.cumsum([0] + list(shard_documents))  # each shard's first document

    def __len__(self) -> int:
        return int(self._first[-1])

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
                f'dataset {name!r} is pre-tokenized only by other tokenizers than {tokenizer.path} ({", ".join(others)}; '
                f'each folder\'s tokens.json names its tokenizer). Pre-tokenize it by this one with `{make}`, name '
                'the tokenizer that made a copy in data.tokenizer, or tokenize on the fly: data.pretokenized=false.')
        logging.info('%s %s: tokenized on the fly by %s; pre-tokenize once with `%s`', name, split, tokenizer.path, make)
        return None
    info = json.loads((where / MARKER).read_text())
    if split not in info['splits']:
        return None
    entry = info['splits'][split]
    stale = _stale(info, entry, corpus.fingerprint(name, data_dir), corpus.split_info(name, data_dir, split).documents,
                   text_field)
    if stale:
        raise corpus.DataError(f'{where} was made from other text than dataset {name!r} holds now ({stale}): make it '
                               f'again with `{make} --overwrite`, or tokenize on the fly: data.pretokenized=false.')
    logging.info('%s %s: pre-tokenized by %s (%s documents, %s tokens) in %s', name, split, tokenizer.path,
                 f'{entry["documents"]:,}', f'{entry["tokens"]:,}', where)
    shards = [str(where / shard) for shard in entry['shards']]
    documents = entry.get('shard_documents') or _shard_documents(shards)
    return TokenSource(shards, info['dtype'], documents, entry['tokens'])


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
    return [_npy_header(f'{shard}.offsets.npy')[1] - 1 for shard in shards]


def tokenize(name: str, data_dir: str, tokenizer: Tokenizer, workers: int | None = None,
             overwrite: bool = False, text_field: str = 'text') -> epath.Path:
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
    dtype = dtype_for(tokenizer.vocab_size)
    workers = workers or os.cpu_count() or 1
    finished = storage.files(target) if target.exists() else {}
    splits, tasks = {}, []
    for split in _splits(dataset):
        corpus.open_split(name, data_dir, split)  # on a store, its text copied down once, before the workers read it
        documents = corpus.split_info(name, data_dir, split).documents
        count = max(1, min(documents, max(MIN_SHARDS, math.ceil(documents / DOCUMENTS_PER_SHARD))))
        bounds = np.linspace(0, documents, count + 1).astype(int)
        shards = [f'{split}-{i:05d}-of-{count:05d}' for i in range(count)]
        splits[split] = {'shards': shards, 'documents': documents, 'shard_documents': np.diff(bounds).tolist()}
        tasks += [(name, data_dir, split, text_field, int(bounds[i]), int(bounds[i + 1]), str(target / shard),
                   tokenizer, dtype.str) for i, shard in enumerate(shards)]
    done = {k for k, task in enumerate(tasks) if f'{os.path.basename(task[6])}.offsets.npy' in finished}
    mine = [task for k, task in enumerate(tasks) if k % jax.process_count() == jax.process_index() and k not in done]
    logging.info('tokenizing %s with %s: %d of %d shards to write here (%d done before), %d processes', name,
                 tokenizer.path, len(mine), len(tasks), len(done), min(workers, max(len(mine), 1)))
    start = time.perf_counter()
    if mine:
        target.mkdir(parents=True, exist_ok=True)
        with multiprocessing.get_context('spawn').Pool(min(workers, len(mine)), initializer=_one_thread) as pool:
            import tqdm
            for _ in tqdm.tqdm(pool.imap_unordered(_write_shard, mine), total=len(mine), unit='shard',
                               desc='tokenizing', disable=None):
                pass
    multihost.sync('vrl.data tokenize: every shard written')
    record = {'dataset_fingerprint': corpus.fingerprint(name, data_dir), 'text_field': text_field}
    multihost.on_process_0(lambda: _write_marker(target, name, tokenizer, dtype, splits, record))
    info = json.loads((target / MARKER).read_text())
    total = sum(entry['tokens'] for entry in info['splits'].values())
    seconds = time.perf_counter() - start
    logging.info('tokenized %s: %s tokens in %.1fs (%s tokens/s) into %s', name, f'{total:,}', seconds,
                 f'{total / max(seconds, 1e-9):,.0f}', target)
    return target


def _clear(target: epath.Path) -> None:
    """Removes an old pre-tokenized copy (`--overwrite`), on local disk or the store."""
    if target.exists():
        target.rmtree()


def _write_marker(target: epath.Path, name: str, tokenizer: Tokenizer, dtype: np.dtype, splits: dict,
                  record: dict) -> None:
    """tokens.json, once every shard is in place: what makes the folder complete; `record` says what
    it was made from."""
    for entry in splits.values():
        entry['tokens'] = sum(_Shard(str(target / shard), dtype, n).token_count()
                              for shard, n in zip(entry['shards'], entry['shard_documents']))
    info = {'format': FORMAT, 'dataset': name, **record, 'tokenizer': tokenizer.path,
            'fingerprint': tokenizer.fingerprint, 'vocab_size': tokenizer.vocab_size, 'dtype': dtype.str,
            'splits': splits}
    storage.write_bytes(target / MARKER, json.dumps(info, indent=2).encode())


def _splits(dataset: epath.Path) -> list[str]:
    info = json.loads((dataset / 'dataset_info.json').read_text())
    return [split['name'] for split in info.get('splits', [])]


def _one_thread() -> None:
    """Each pool process encodes on one core: the processes are the parallelism."""
    os.environ['TOKENIZERS_PARALLELISM'] = 'false'


def _write_shard(task: tuple) -> int:
    """Documents [start, end) of a split as one shard: SHARD.tokens, their ids one after another,
    and SHARD.offsets.npy, where each document starts (and the end), placed last: a shard whose
    offsets are there is whole. Written beside the target on local disk (then renamed), in a
    temporary folder for an object store (then uploaded)."""
    name, data_dir, split, text_field, start, end, path, tokenizer, dtype = task
    source = corpus.open_split(name, data_dir, split)
    with tempfile.TemporaryDirectory() as scratch:
        local = os.path.join(scratch, os.path.basename(path)) if storage.is_remote(path) else path
        lengths = []
        with open(f'{local}.tokens.partial', 'wb') as out:
            for first in range(start, end, ENCODE_CHUNK):
                records = [source[i][text_field] for i in range(first, min(first + ENCODE_CHUNK, end))]
                texts = [r.decode('utf-8') if isinstance(r, bytes) else r for r in records]
                for ids in tokenizer.encode_batch(texts):
                    out.write(ids.astype(dtype).tobytes())
                    lengths.append(len(ids))
        storage.put_file(f'{local}.tokens.partial', storage.path(f'{path}.tokens'))
        with open(f'{local}.offsets.partial', 'wb') as out:
            np.save(out, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))
        storage.put_file(f'{local}.offsets.partial', storage.path(f'{path}.offsets.npy'))
    return end - start
