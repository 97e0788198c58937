"""The files of a pre-tokenized copy of a dataset, written and read in one place.

    DATA_DIR/NAME/VERSION/vrl_tokens/<tokenizer fingerprint>/
        train-00000-of-00008.tokens        the shard's documents' ids one after another, in the
                                           dataset's record order, little-endian uint16
                                           (vocabularies up to 65,536) or uint32
        train-00000-of-00008.offsets.npy   int64: where each document starts, and the end
        ...
        tokens.json                        written last, what makes the folder complete: the
                                           tokenizer, the dtype, and per split its shards and
                                           document and token counts

`ShardWriter` streams a shard out (a document's ids at a time, memory flat however many documents)
and moves it into place whole; `Shard` reads one in place, on local disk or an object store.
`vrl.data tokenize` (vrl/data/tokens.py) and `vrl.data prepare --tokenizer` (vrl/data/build.py)
both write with them.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import threading
from typing import Protocol

import numpy as np
from etils import epath

from vrl.core import storage
from vrl.data.sources import DataError

MARKER = 'tokens.json'
FORMAT = 2  # 2: tokens.json records the dataset's fingerprint, the text field and each shard's documents
ENCODE_CHUNK = 256  # documents per encode_batch call


class Encoder(Protocol):
    """What a pre-tokenized copy needs of a tokenizer (vrl/data/tokenizer.py's are)."""

    path: str
    fingerprint: str
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...


def folder(dataset_path: epath.Path, tokenizer: Encoder) -> epath.Path:
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


class Shard:
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
            return np.asarray(self._offsets[first : last + 1])
        if 8 * self._documents > OFFSETS_HELD_BYTES // 16:
            return self._read_offsets(first, last)
        whole = _HELD.get(self._path)
        if whole is None:
            whole = _HELD.put(self._path, self._read_offsets(0, self._documents))
        return whole[first : last + 1]

    def _read_offsets(self, first: int, last: int) -> np.ndarray:
        if not self._header:
            self._header, _ = npy_header(f'{self._path}.offsets.npy')
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
        return np.frombuffer(storage.read_range(f'{self._path}.tokens', size * start, size * end), self._dtype).astype(
            np.int32
        )


def npy_header(url: str) -> tuple[int, int]:
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
    raise DataError(f'{url} is not a .npy file of offsets: make the pre-tokenized copy again (--overwrite)')


class ShardWriter:
    """Writes one shard, a document's ids at a time: the ids to `.tokens`, the offsets to a flat
    file (so that memory does not grow with the documents), both beside the target on local disk or
    in a temporary folder for an object store. `close()` moves the tokens into place, then the
    offsets as .npy, last: a shard whose offsets are there is whole."""

    def __init__(self, path: str, dtype: np.dtype):
        self._path, self._dtype = path, np.dtype(dtype)
        self._scratch = tempfile.TemporaryDirectory() if storage.is_remote(path) else None
        self._local = os.path.join(self._scratch.name, os.path.basename(path)) if self._scratch else path
        os.makedirs(os.path.dirname(self._local), exist_ok=True)
        self._tokens = open(f'{self._local}.tokens.partial', 'wb')
        self._ends = open(f'{self._local}.ends.partial', 'wb')
        self.documents = self.tokens = 0

    def write(self, ids: np.ndarray) -> None:
        self._tokens.write(np.asarray(ids).astype(self._dtype).tobytes())
        self.tokens += len(ids)
        self.documents += 1
        self._ends.write(np.int64(self.tokens).tobytes())

    def close(self) -> None:
        self._tokens.close()
        self._ends.close()
        storage.put_file(f'{self._local}.tokens.partial', storage.path(f'{self._path}.tokens'))
        with open(f'{self._local}.offsets.partial', 'wb') as out, open(f'{self._local}.ends.partial', 'rb') as ends:
            np.lib.format.write_array_header_1_0(
                out, {'descr': '<i8', 'fortran_order': False, 'shape': (self.documents + 1,)}
            )
            out.write(np.int64(0).tobytes())
            while chunk := ends.read(1 << 20):
                out.write(chunk)
        os.remove(f'{self._local}.ends.partial')
        storage.put_file(f'{self._local}.offsets.partial', storage.path(f'{self._path}.offsets.npy'))
        if self._scratch:
            self._scratch.cleanup()


def write_marker(target: epath.Path, name: str, tokenizer: Encoder, splits: dict, record: dict) -> None:
    """tokens.json, once every shard is in place: what makes the folder complete. `splits` holds per
    split its shards, documents, shard_documents and tokens; `record` says what the copy was made
    from (the dataset's fingerprint, the text field)."""
    info = {
        'format': FORMAT,
        'dataset': name,
        **record,
        'tokenizer': tokenizer.path,
        'fingerprint': tokenizer.fingerprint,
        'vocab_size': tokenizer.vocab_size,
        'dtype': dtype_for(tokenizer.vocab_size).str,
        'splits': splits,
    }
    storage.write_bytes(target / MARKER, json.dumps(info, indent=2).encode())
