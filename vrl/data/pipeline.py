"""The input pipeline: TFDS source -> tokenize (or a pre-tokenized copy) -> shuffle -> per-process
shard -> pack -> batch.

Built on grain: documents, in blocks of consecutive ones for a corpus of short documents (one
document each for web pages; `_Blocks`), are shuffled globally with a seed (a new order each
epoch), each process takes every `process_count`-th block, worker processes tokenize, and
packing runs in the main process so that batches do not depend on the worker count. A
mixture's datasets go through this apart, and their windows are interleaved by weight
(`_MixIterator`). The iterator's state (`get_state` / `set_state`) restores the exact position.

Packing: every document becomes a group `separator + tokens`, separator = [EOS] (+ [BOS] with
`add_bos`), so EOS both ends one document and opens the next; an epoch's stream ends with one
more EOS. Sequences are windows of L + 1 tokens that overlap by one: inputs = stream[i:i+L],
targets = stream[i+1:i+L+1], so every token after the first is a target exactly once. The
last window is padded (loss_mask 0). With `document_masking`, segment ids (1, 2, ... per
window; 0 = padding) and positions restarting at each group keep attention and RoPE within
a document.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from typing import Any, Iterator

import grain
import numpy as np
import tqdm
from absl import flags

from vrl.core import multihost, storage
from vrl.core.config import ConfigError
from vrl.data import corpus, layout, tokens, windows
from vrl.data.config import DataConfig
from vrl.data.tokenizer import Tokenizer, TokenizerError
from vrl.data.tokenizer import train as train_tokenizer

Batch = dict[str, np.ndarray]  # inputs, targets, loss_mask [, segment_ids, positions]: (B, L)


BYTES_PER_TOKEN = (
    4  # a grain element holds about a window of stored text, seq_len * this many bytes (a document at least),
)
MIN_BLOCKS = 1000  # and a split has at least this many elements where it has the documents (a fine-grained shuffle)


class _OnTheFly:
    """A split's documents tokenized as they are read from its text (`corpus.open_split`); with
    `count_bytes`, each document is (ids, the UTF-8 bytes of text each id stands for)."""

    def __init__(self, text: Any, tokenizer: Tokenizer, text_field: str, count_bytes: bool = False):
        self._text, self._tokenizer, self._field, self.count_bytes = text, tokenizer, text_field, count_bytes

    def token_count(self, sample: int = 1000) -> float:
        """The split's tokens, estimated from `sample` documents spread evenly over it."""
        documents = len(self._text)
        picks = np.unique(np.linspace(0, documents - 1, min(sample, documents)).astype(int))
        records = [self._text[int(i)][self._field] for i in picks]
        texts = [t.decode('utf-8') if isinstance(t, bytes) else t for t in records]
        return float(np.mean([len(ids) for ids in self._tokenizer.encode_batch(texts)])) * documents

    def documents(self, indices: range) -> list[np.ndarray] | list[tuple[np.ndarray, np.ndarray]]:
        # array_record reads a list on a thread pool: ~350 us to start, then faster than one by one
        records = self._text.__getitems__(list(indices)) if len(indices) > 16 else [self._text[i] for i in indices]
        texts = [t.decode('utf-8') if isinstance(t, bytes) else t for t in (record[self._field] for record in records)]
        if self.count_bytes:
            return self._tokenizer.encode_counting_bytes(texts)
        return self._tokenizer.encode_batch(texts)


class _Blocks:
    """A split as blocks of consecutive documents, each read at once as a list of token arrays:
    block b holds documents [b R, (b + 1) R). grain spends ~50 us on every element it shuffles,
    shards and prefetches, which bounded a corpus of 50-token documents at ~0.8M tokens/s; R
    documents per element pay it once. R comes from the stored split's bytes per document, so that
    a block holds about one window of text (seq_len tokens of BYTES_PER_TOKEN bytes; a batch then
    draws about as many places in the corpus as it has windows, as a corpus of long documents
    does), and from its size (MIN_BLOCKS): 1 for web pages and small splits. `source` is a
    pre-tokenized copy (tokens.TokenSource) or the text tokenized on the fly (`_OnTheFly`); both
    cut the same blocks. Picklable: grain workers read their own."""

    def __init__(self, source: tokens.TokenSource | _OnTheFly, split: corpus.SplitInfo, seq_len: int, where: str):
        self.source, self.where = source, where
        self.count_bytes = isinstance(source, _OnTheFly) and source.count_bytes  # documents come as (ids, bytes)
        self.documents = split.documents
        window_bytes = BYTES_PER_TOKEN * seq_len
        self.per_block = max(
            1, min(window_bytes * split.documents // max(split.num_bytes, 1), self.documents // MIN_BLOCKS)
        )

    def __len__(self) -> int:
        return -(-self.documents // self.per_block)

    def __getitem__(self, block: int) -> list[np.ndarray]:
        return self.source.documents(range(block * self.per_block, min((block + 1) * self.per_block, self.documents)))


class _PackIterator(grain.DatasetIterator):
    """Blocks of one dataset's documents (each document separator first) joined into windows of
    L + 1 tokens that overlap by one. Each document arrives as a piece and is joined once a window's
    worth has arrived: joining the buffer per document copied it once per document. With
    `count_bytes`, a document arrives as (ids, bytes of text per id) and each example gains
    'target_bytes' (the separators stand for no text)."""

    def __init__(
        self,
        parent: grain.DatasetIterator,
        documents_per_block: int,
        reading: dict,
        seq_len: int,
        separator: np.ndarray,
        eos_id: int,
        pad_id: int,
        document_masking: bool,
        count_bytes: bool,
    ):
        super().__init__(parent)
        self._per_block = documents_per_block  # what the parent's position counts
        self._reading = reading  # how the parent shuffles: a position saved another way is refused
        self._L, self._separator, self._eos, self._pad = seq_len, separator, eos_id, pad_id
        self._document_masking, self._count_bytes = document_masking, count_bytes
        # the stream not yet emitted (the next window's start): its tokens, each token's document
        # group and (count_bytes) the bytes of text it stands for
        self._tokens, self._groups, self._bytes = np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32)
        self._pieces: list[tuple[np.ndarray, int, np.ndarray | None]] = []  # arrived, not yet joined
        self._piece_tokens = 0
        self._n_groups = 0
        self._exhausted = False

    def _add(self, tokens: np.ndarray, group: int, n_bytes: np.ndarray | None) -> None:
        self._pieces.append((tokens, group, n_bytes))
        self._piece_tokens += len(tokens)

    def _document(self, document: np.ndarray | tuple[np.ndarray, np.ndarray]) -> None:
        tokens, n_bytes = document if self._count_bytes else (document, None)
        self._n_groups += 1
        self._add(self._separator, self._n_groups, np.zeros(len(self._separator), np.int32))
        self._add(tokens, self._n_groups, n_bytes)

    def _join(self) -> None:
        if self._pieces:
            tokens, groups, n_bytes = zip(*self._pieces)
            self._tokens = np.concatenate([self._tokens, *tokens]).astype(np.int32)
            lengths = list(map(len, tokens))
            self._groups = np.concatenate([self._groups, np.repeat(np.asarray(groups, np.int64), lengths)])
            if self._count_bytes:
                self._bytes = np.concatenate([self._bytes, *n_bytes]).astype(np.int32)
            self._pieces, self._piece_tokens = [], 0

    def __next__(self) -> dict[str, np.ndarray]:
        L = self._L
        while len(self._tokens) + self._piece_tokens < L + 1 and not self._exhausted:
            try:
                block = next(self._parent)
            except StopIteration:
                self._exhausted = True
                if self._n_groups:  # the last document's end
                    self._add(np.array([self._eos], np.int32), self._n_groups, np.zeros(1, np.int32))
                break
            for document in block:
                self._document(document)
        self._join()
        if len(self._tokens) < 2:
            raise StopIteration
        n = min(L + 1, len(self._tokens))
        example = _example(self._tokens[:n], self._groups[: n - 1], L, self._pad, self._document_masking)
        if self._count_bytes:
            example['target_bytes'] = np.zeros(L, np.int32)
            example['target_bytes'][: n - 1] = self._bytes[1:n]
            self._bytes = self._bytes[n - 1 :]
        self._tokens, self._groups = self._tokens[n - 1 :], self._groups[n - 1 :]
        return example

    def get_state(self) -> dict[str, Any]:  # between windows every piece is joined
        return {
            'parent': self._parent.get_state(),
            'tokens': self._tokens.tolist(),
            'groups': self._groups.tolist(),
            'n_groups': self._n_groups,
            'exhausted': self._exhausted,
            'documents_per_element': [self._per_block],
            'reading': self._reading,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        reading = state.get('reading', {'shuffle': 'documents'})  # a position saved without it: documents
        if reading['shuffle'] != self._reading['shuffle']:
            raise corpus.DataError(
                f'the saved data position was read with data.shuffle={reading["shuffle"]!r}, and this run reads '
                f"with {self._reading['shuffle']!r} (data.shuffle, or 'auto' on another store): set "
                f'--config.data.shuffle={reading["shuffle"]} to resume, or start a new --workdir from these weights '
                'with --init_from=CHECKPOINT.'
            )
        saved = state.get('documents_per_element', [1])  # a position saved without it counts documents
        if saved != [self._per_block]:
            raise corpus.DataError(
                f'the saved data position counts grain elements of {saved} documents (per dataset), but this '
                f'pipeline reads {[self._per_block]} (blocks of about a window of text, data.seq_len tokens): '
                'restored, it would land elsewhere in the epoch. Resume with the vrl version and data.seq_len that '
                'saved it, or start a new --workdir from these weights with --init_from=CHECKPOINT.'
            )
        self._parent.set_state(state['parent'])
        self._tokens = np.asarray(state['tokens'], np.int32)
        self._groups = np.asarray(state['groups'], np.int64)
        self._n_groups, self._exhausted = state['n_groups'], state['exhausted']


def _example(
    window: np.ndarray, groups: np.ndarray, L: int, pad_id: int, document_masking: bool
) -> dict[str, np.ndarray]:
    """One packed sequence from a window of n <= L + 1 tokens and the groups of its first n - 1."""
    n = len(window) - 1
    inputs = np.full(L, pad_id, np.int32)
    targets = np.full(L, pad_id, np.int32)
    inputs[:n], targets[:n] = window[:-1], window[1:]
    example = {'inputs': inputs, 'targets': targets, 'loss_mask': (np.arange(L) < n).astype(np.int32)}
    if not document_masking:
        return example
    segment_ids = np.zeros(L, np.int32)
    segment_ids[:n] = groups - groups[0] + 1
    starts = np.flatnonzero(np.diff(segment_ids[:n], prepend=0))  # first index of each segment
    positions = np.zeros(L, np.int32)
    positions[:n] = np.arange(n) - starts[np.searchsorted(starts, np.arange(n), side='right') - 1]
    return example | {'segment_ids': segment_ids, 'positions': positions}


class _PackIterDataset(grain.IterDataset):
    def __init__(self, parent: grain.IterDataset, *args: Any):
        super().__init__(parent)
        self._args = args

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), *self._args)


class _MixIterator(grain.DatasetIterator):
    """Packed windows of each dataset of a mixture (each packed apart: a window holds one dataset's
    text), interleaved in the token shares of the mixture's phase by step (DataConfig.phases):
    window n of this process is in step n // windows_per_step, and within a phase each window goes
    to the dataset furthest behind its share (the first on a tie), so every process makes the same
    choices and a step's tokens follow the weights to within a window. Each example gains
    'tokens_read': (datasets,) int64, the target tokens this process has read from each dataset so
    far, kept in the state, so that a resume continues the count. The state names the share of the
    batch rows it reads (`share`: index, count), and a resume reading another share is refused."""

    def __init__(
        self,
        members: list[grain.DatasetIterator],
        phases: list[tuple[int, tuple[float, ...]]],
        windows_per_step: int,
        share: tuple[int, int],
    ):
        super().__init__(members)
        self._members, self._phases, self._per_step, self._share = members, phases, windows_per_step, share
        self._windows = 0
        self._phase = 0
        self._taken = [0] * len(members)  # windows of each dataset in this phase
        self._tokens_read = [0] * len(members)

    def _next_member(self) -> int:
        """The dataset furthest behind its share of this phase's windows (plain Python: a few
        datasets, once a window)."""
        phase = self._phase
        while phase + 1 < len(self._phases) and self._phases[phase + 1][0] * self._per_step <= self._windows:
            phase += 1
        if phase != self._phase:
            self._phase, self._taken = phase, [0] * len(self._members)
        weights = self._phases[phase][1]
        return min((i for i, w in enumerate(weights) if w > 0), key=lambda i: (self._taken[i] + 1) / weights[i])

    def __next__(self) -> dict[str, np.ndarray]:
        member = self._next_member() if len(self._members) > 1 else 0
        example = next(self._members[member])
        self._windows += 1
        self._taken[member] += 1
        self._tokens_read[member] += int(example['loss_mask'].sum())
        example['tokens_read'] = np.array(self._tokens_read, np.int64)
        return example

    def get_state(self) -> dict[str, Any]:
        return {
            'members': [m.get_state() for m in self._members],
            'windows': self._windows,
            'phase': self._phase,
            'taken': list(self._taken),
            'tokens_read': list(self._tokens_read),
            'share': list(self._share),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if 'members' not in state:  # the older format: one packer's position for all datasets
            if len(self._members) > 1:
                raise corpus.DataError(
                    'the saved data position is of a mixture whose datasets were mixed before packing (an older '
                    'vrl): it cannot be restored into this order, which packs each dataset apart. Start a new '
                    '--workdir from these weights with --init_from=CHECKPOINT.'
                )
            state = {'members': [state], 'windows': 0, 'phase': 0, 'taken': [0], 'tokens_read': [0]}
        saved_share = state.get('share', list(self._share))  # states without one: a share per process
        if saved_share != list(self._share):
            raise corpus.DataError(
                f"the saved data position is of share {saved_share[0]} of {saved_share[1]} of every batch's rows, "
                f'and this mesh has this process read share {self._share[0]} of {self._share[1]} (a sequence split '
                'over mesh.context across hosts makes those hosts read the same rows): the data would not go on '
                'where it stopped. Resume with the mesh it was saved with, or start a new --workdir from these '
                'weights with --init_from=CHECKPOINT.'
            )
        for member, saved in zip(self._members, state['members'], strict=True):
            member.set_state(saved)
        self._windows, self._phase = state['windows'], state['phase']
        self._taken, self._tokens_read = list(state['taken']), list(state['tokens_read'])


class _MixIterDataset(grain.IterDataset):
    def __init__(
        self,
        members: list[grain.IterDataset],
        phases: list[tuple[int, tuple[float, ...]]],
        windows_per_step: int,
        share: tuple[int, int],
    ):
        super().__init__(members)
        self._members, self._phases, self._per_step, self._share = members, phases, windows_per_step, share

    def __iter__(self) -> _MixIterator:
        return _MixIterator([m.__iter__() for m in self._members], self._phases, self._per_step, self._share)


def _separator(cfg: DataConfig, tokenizer: Tokenizer) -> np.ndarray:
    return np.array([tokenizer.eos_id] + ([tokenizer.bos_id] if cfg.add_bos else []), np.int32)


def prompt_tokens(cfg: DataConfig, tokenizer: Tokenizer, text: str) -> list[int]:
    """A prompt as the model saw document starts in training: the separator, then the text."""
    return _separator(cfg, tokenizer).tolist() + tokenizer.encode(text).tolist()


def _source(
    cfg: DataConfig, tokenizer: Tokenizer, name: str, split: str, count_bytes: bool = False
) -> tokens.TokenSource | _OnTheFly:
    """A split's documents as ids: its pre-tokenized copy for this tokenizer when it has one
    (data.pretokenized), else its text tokenized as it is read; the text always where each id's
    bytes of text are counted (`count_bytes`: they come from the text)."""
    pretokenized = cfg.pretokenized and not count_bytes
    found = tokens.find(name, cfg.data_dir, split, tokenizer, cfg.text_field) if pretokenized else None
    if found is not None:
        return found
    return _OnTheFly(corpus.open_split(name, cfg.data_dir, split), tokenizer, cfg.text_field, count_bytes)


def opening_words(cfg: DataConfig, tokenizer: Tokenizer, pieces: int = 8) -> str:
    """The first line of the first `pieces` tokens of the first document of the validation split of
    data.name (or of the mixture's first dataset), as text: a prompt in the run's own data."""
    source = _source(cfg, tokenizer, cfg.name or cfg.sources()[0][0], cfg.eval_split)
    words = tokenizer.decode(source.documents(range(1))[0][:pieces].tolist()).strip()
    return words.split('\n', 1)[0].rstrip()  # its first line


def _blocks(cfg: DataConfig, tokenizer: Tokenizer, name: str, split: str, count_bytes: bool = False) -> _Blocks:
    """Split `split` of dataset `name` as blocks of consecutive documents' ids; the ids come from its
    pre-tokenized copy for this tokenizer when it has one (`_source`); the blocks, and so
    everything after, are the same either way."""
    return _Blocks(
        _source(cfg, tokenizer, name, split, count_bytes),
        corpus.split_info(name, cfg.data_dir, split),
        cfg.seq_len,
        f'{name} {split}',
    )


def _windows(
    blocks: _Blocks,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    seed: int | None,
    num_epochs: int | None,
    process_index: int,
    process_count: int,
    share: float = 1.0,
) -> grain.IterDataset:
    """One dataset's packed windows of L + 1 tokens, from this process's share of its documents,
    shuffled with `seed` (None: in order, every `process_count`-th block) and repeated `num_epochs`
    times (None: forever), as data.shuffle says (`_window_shuffled`); read by `share` of the reading
    threads and worker processes (a mixture's dataset reads beside the others)."""
    windowed = seed is not None and _window_shuffled(cfg, blocks.source, blocks.where)
    if windowed:
        ds, per_element, reading = _window_read(blocks, cfg, seed, num_epochs, process_index, process_count, share)
    else:
        ds, per_element, reading = _document_read(blocks, cfg, seed, num_epochs, process_index, process_count, share)
    return _PackIterDataset(
        ds,
        per_element,
        reading,
        cfg.seq_len,
        _separator(cfg, tokenizer),
        tokenizer.eos_id,
        tokenizer.pad_id,
        cfg.document_masking,
        blocks.count_bytes,
    )


def _window_shuffled(cfg: DataConfig, source: tokens.TokenSource | _OnTheFly, where: str) -> bool:
    """Whether training reads split `where` from `source` in windows (data.shuffle): 'auto' does for a
    pre-tokenized copy on an object store, where a request costs tens of milliseconds."""
    pretokenized = isinstance(source, tokens.TokenSource)
    if cfg.shuffle == 'windows' and not pretokenized:
        raise corpus.DataError(
            f"data.shuffle='windows' reads a pre-tokenized copy, and {where} is tokenized on "
            "the fly: pre-tokenize it (`python -m vrl.data tokenize`) or use data.shuffle='documents'."
        )
    return cfg.shuffle == 'windows' or (cfg.shuffle == 'auto' and pretokenized and storage.is_remote(cfg.data_dir))


def _document_read(
    blocks: _Blocks,
    cfg: DataConfig,
    seed: int | None,
    num_epochs: int | None,
    process_index: int,
    process_count: int,
    share: float,
) -> tuple[grain.IterDataset, int, dict]:
    """Small blocks (about a sequence of text each) shuffled globally, every `process_count`-th to
    this process, read ahead by grain's threads and worker processes."""
    ds = grain.MapDataset.source(blocks)
    ds = (ds if seed is None else ds.shuffle(seed=seed)).repeat(num_epochs)
    ds = ds[process_index::process_count].to_iter_dataset(_read_options(cfg, share))
    if workers := math.ceil(cfg.num_workers * share):
        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; notebooks never parse them
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=max(cfg.prefetch, 1) * 16)
        )
    return ds, blocks.per_block, {'shuffle': 'documents'}


def _io_blocks(cfg: DataConfig, source: tokens.TokenSource, where: str) -> windows.Blocks:
    return windows.plan(source.shard_documents, source.token_count(), cfg.block_tokens, where)


REMOTE_WINDOW_READS = 8  # data.read_threads=-1 in windows on an object store: block reads in flight per process


def _window_read(
    blocks: _Blocks,
    cfg: DataConfig,
    seed: int,
    num_epochs: int | None,
    process_index: int,
    process_count: int,
    share: float,
) -> tuple[grain.IterDataset, int, dict]:
    """I/O blocks of data.block_tokens read whole, shuffled in windows of data.window_blocks
    (vrl/data/windows.py), handed out about a sequence of text at a time."""
    source = blocks.source
    io = _io_blocks(cfg, source, blocks.where)
    reads = cfg.read_threads if cfg.read_threads >= 0 else REMOTE_WINDOW_READS if storage.is_remote(cfg.data_dir) else 0
    reading = {'shuffle': 'windows', 'block_documents': io.per_block, 'window_blocks': cfg.window_blocks}
    ds = windows.WindowDataset(
        source,
        io,
        window_blocks=cfg.window_blocks,
        per_element=blocks.per_block,
        seed=seed,
        num_epochs=num_epochs,
        process_index=process_index,
        process_count=process_count,
        reads=math.ceil(reads * share),
        settings=reading,
    )
    return ds, blocks.per_block, reading


def _batches(windows: grain.IterDataset, cfg: DataConfig, process_count: int) -> grain.IterDataset:
    """Batches of this process's share; a finite pass ends with a padded (loss_mask 0) batch."""
    batch_size = per_process_batch_size(cfg, process_count)
    return windows.batch(batch_size).map(functools.partial(_pad_batch, batch_size=batch_size))


REMOTE_READ_THREADS = 64  # data.read_threads=-1 on an object store: ranged reads in flight per process


def _read_options(cfg: DataConfig, share: float) -> grain.ReadOptions:
    """Reading in this process's threads, `share` of them for one dataset. On local disk none by
    default: grain's threads busy-wait on their futures and cost more than a mapped read. On an
    object store, where a block is a ranged read of tens of milliseconds, REMOTE_READ_THREADS
    reads in flight (data.read_threads sets it). The buffer is twice the threads: grain 0.2's
    prefetch statistics scan the whole buffer on every element (~3 ms an element at 2,048)."""
    threads = cfg.read_threads
    if threads < 0:
        threads = REMOTE_READ_THREADS if storage.is_remote(cfg.data_dir) else 0
    threads = math.ceil(threads * share)
    return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(threads, 1) * 2)


def provenance(cfg: DataConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a run reads, for its record (config.json, W&B): the tokenizer (its file's fingerprint and
    special ids) and each dataset (version, fingerprint, weight, whether its ids come pre-tokenized,
    the tokens of its train split: counted when pre-tokenized, else estimated, and how they are
    shuffled)."""
    datasets = {}
    for name, weight in cfg.sources():
        source = _source(cfg, tokenizer, name, cfg.train_split)
        pretokenized = isinstance(source, tokens.TokenSource)
        count = source.token_count()
        where = f'{name} {cfg.train_split}'
        shuffle = 'by document'
        if _window_shuffled(cfg, source, where):
            per_block = _io_blocks(cfg, source, where).per_block
            shuffle = f'in windows of {cfg.window_blocks} blocks of ~{round(per_block * count / len(source)):,} tokens'
        datasets[name] = {
            'version': corpus.dataset_path(name, cfg.data_dir).name,
            'fingerprint': corpus.fingerprint(name, cfg.data_dir),
            'weight': weight,
            'pretokenized': pretokenized,
            'train_tokens': round(count),
            'train_tokens_are': 'counted' if pretokenized else 'estimated from 1,000 documents',
            'shuffle': shuffle,
        }
    return {
        'tokenizer': {
            'path': tokenizer.path,
            'fingerprint': tokenizer.fingerprint,
            'vocab_size': tokenizer.vocab_size,
            'eos_id': tokenizer.eos_id,
            'bos_id': tokenizer.bos_id,
            'pad_id': tokenizer.pad_id,
        },
        'datasets': datasets,
    }


def epochs_per_step(read: dict[str, Any], tokens_per_step: int) -> dict[str, float]:
    """How far into an epoch of each dataset a step takes the run: its share of a step's tokens
    (its weight over all weights) over its train split's tokens (`read`: provenance's)."""
    datasets = read['datasets']
    total = sum(d['weight'] for d in datasets.values())
    return {name: tokens_per_step * d['weight'] / total / max(d['train_tokens'], 1) for name, d in datasets.items()}


def provenance_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What a run reads now that it did not when `saved` was recorded: another tokenizer (other ids
    for the same text) or other contents of a dataset; [] when only paths or the reading differ."""
    changes = []
    if saved['tokenizer']['fingerprint'] != now['tokenizer']['fingerprint']:
        changes.append(
            f'the tokenizer: {saved["tokenizer"]["path"]} (fingerprint {saved["tokenizer"]["fingerprint"]}) '
            f'then, {now["tokenizer"]["path"]} ({now["tokenizer"]["fingerprint"]}) now'
        )
    for name, then in saved['datasets'].items():
        if name in now['datasets'] and then['fingerprint'] != now['datasets'][name]['fingerprint']:
            changes.append(
                f'dataset {name!r}: prepared again from other inputs since (fingerprint '
                f'{then["fingerprint"]} then, {now["datasets"][name]["fingerprint"]} now)'
            )
    return changes


def per_process_batch_size(cfg: DataConfig, process_count: int) -> int:
    if cfg.batch_size % process_count:
        raise ConfigError(
            f'data.batch_size={cfg.batch_size} is invalid: allowed a multiple of the process count {process_count}.'
        )
    return cfg.batch_size // process_count


@dataclasses.dataclass(frozen=True)
class TrainData:
    """The training split of data.name or of each dataset of data.mixture, opened for `tokenizer`
    (`open`: a missing split, a pre-tokenized copy for another tokenizer or a data.shuffle a dataset
    cannot serve is a DataError there), and the batches of any process's share of them (`dataset`)."""

    cfg: DataConfig
    tokenizer: Tokenizer
    blocks: tuple[_Blocks, ...]  # per dataset of cfg.sources()

    @classmethod
    def open(cls, cfg: DataConfig, tokenizer: Tokenizer) -> TrainData:
        blocks = tuple(_blocks(cfg, tokenizer, name, cfg.train_split) for name, _ in cfg.sources())
        for opened in blocks:
            _window_shuffled(cfg, opened.source, opened.where)
        return cls(cfg, tokenizer, blocks)

    def dataset(self, process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
        """Endless (or data.num_epochs) shuffled, packed batches of share `process_index` of
        `process_count` of the global batch (TrainSteps.row_share: a share per process unless a
        sequence is split across hosts), each dataset shuffled with its own seed and packed apart,
        their windows interleaved by `_MixIterator`; each batch also holds 'tokens_read': (rows,
        datasets) int64, this process's target tokens read from each dataset up to each row."""
        cfg = self.cfg
        members = [
            _windows(
                blocks,
                cfg,
                self.tokenizer,
                seed=cfg.seed + i,
                num_epochs=cfg.num_epochs or None,
                process_index=process_index,
                process_count=process_count,
                share=1 / len(self.blocks),
            )
            for i, blocks in enumerate(self.blocks)
        ]
        mixed = _MixIterDataset(
            members, cfg.phases(), per_process_batch_size(cfg, process_count), (process_index, process_count)
        )
        # packed and batched on a thread ahead of the step, which only takes a ready batch; its position
        # (get_state) is the last batch taken's
        return grain.experimental.ThreadPrefetchIterDataset(
            _batches(mixed, cfg, process_count), prefetch_buffer_size=cfg.prefetch
        )


def train_dataset(
    cfg: DataConfig, tokenizer: Tokenizer, process_index: int = 0, process_count: int = 1
) -> grain.IterDataset:
    """`TrainData.dataset` of the data `cfg` names, opened here."""
    return TrainData.open(cfg, tokenizer).dataset(process_index, process_count)


EVAL_KEPT_BYTES = 1 << 30  # a pass of an evaluation set up to this size is kept in memory for the next


class EvalSets:
    """The validation sets of `cfg` for `tokenizer`, each opened (listed, its text found) on first use
    and kept, and each pass's batches kept (up to EVAL_KEPT_BYTES): a run's evaluations after the
    first read and tokenize nothing."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self._opened: dict[tuple[str, str], _Blocks] = {}
        self._kept: dict[tuple, list[Batch]] = {}

    def batches(
        self,
        max_batches: int,
        process_index: int = 0,
        process_count: int = 1,
        name: str | None = None,
        split: str | None = None,
    ) -> Iterator[Batch]:
        """Split `split` (default data.eval_split) of dataset `name` (default data.name) in a fixed
        order, one pass, every batch full size (padding has loss_mask 0), with 'target_bytes': the
        UTF-8 bytes of text each target stands for (Tokenizer.encode_counting_bytes).

        Every process gets the same number of batches, all-padding ones after its share ends: with
        max_batches > 0 exactly that many; with 0 (the whole split) as many as the process with the
        most has (the `process_count` processes of a jax.distributed job agree at each batch)."""
        key = (name or self.cfg.name, split or self.cfg.eval_split)
        this_pass = (key, max_batches, process_index, process_count)
        if this_pass in self._kept:
            yield from self._kept[this_pass]
            return
        kept, size = [], 0  # every process's batches have the same shapes: all keep them, or none
        for batch in self._read(key, max_batches, process_index, process_count):
            size += sum(array.nbytes for array in batch.values())
            if size <= EVAL_KEPT_BYTES:
                kept.append(batch)
            yield batch
        if size <= EVAL_KEPT_BYTES:
            self._kept[this_pass] = kept

    def _read(self, key: tuple[str, str], max_batches: int, process_index: int, process_count: int) -> Iterator[Batch]:
        cfg = self.cfg
        if key not in self._opened:
            self._opened[key] = _blocks(cfg, self.tokenizer, key[0], key[1], count_bytes=True)
        ds = iter(
            _batches(
                _windows(
                    self._opened[key],
                    cfg,
                    self.tokenizer,
                    seed=None,
                    num_epochs=1,
                    process_index=process_index,
                    process_count=process_count,
                ),
                cfg,
                process_count,
            )
        )
        padding = _pad_batch(_empty_like(cfg), per_process_batch_size(cfg, process_count))
        count = 0
        while not max_batches or count < max_batches:
            batch = next(ds, None)
            if not max_batches and (batch is None if process_count == 1 else multihost.every_process(batch is None)):
                return  # the whole split: every process's share has ended
            yield padding if batch is None else batch
            count += 1


def eval_batches(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    max_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    name: str | None = None,
    split: str | None = None,
) -> Iterator[Batch]:
    """EvalSets.batches of a set opened for this pass alone."""
    return EvalSets(cfg, tokenizer).batches(max_batches, process_index, process_count, name, split)


def next_batch(iterator: Iterator[Batch], finite: bool, vocab_size: int = 0) -> Batch | None:
    """The next training batch; None once a finite pass (data.num_epochs) has ended on any process,
    on every process at the same step: the processes' shares hold different numbers of batches, and
    one that stopped alone would leave the others waiting in the step's collectives. Endless data
    asks no other process. A token id at or above `vocab_size` (the model's; 0: unchecked) is a
    DataError: the model would train on garbage and read as a non-finite loss."""
    batch = next(iterator, None)
    if batch is not None and vocab_size:
        top = max(int(batch['inputs'].max(initial=0)), int(batch['targets'].max(initial=0)))
        if top >= vocab_size:
            raise corpus.DataError(
                f'the training data holds token id {top:,}, beyond model.vocab_size={vocab_size:,}: its ids are '
                'not of this tokenizer and model (check data.tokenizer and model.vocab_size), or a pre-tokenized '
                'shard is damaged (make the copy again with `python -m vrl.data tokenize ... --overwrite`, or '
                'train with data.pretokenized=false).'
            )
    if finite:
        return batch if multihost.every_process(batch is not None) else None
    if batch is None:
        raise corpus.DataError('the training data ended, though data.num_epochs=0 repeats it forever')
    return batch


def _empty_like(cfg: DataConfig) -> Batch:
    """An evaluation batch of no rows."""
    masking = ('segment_ids', 'positions') if cfg.document_masking else ()
    keys = ('inputs', 'targets', 'loss_mask', 'target_bytes') + masking
    return {k: np.zeros((0, cfg.seq_len), np.int32) for k in keys}


def _pad_batch(batch: Batch, batch_size: int) -> Batch:
    missing = batch_size - len(batch['inputs'])
    return {
        k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)]) if missing else v for k, v in batch.items()
    }


def build_built_ins(cfg: DataConfig) -> None:
    """Every built-in corpus the config reads, built on first use: run by every process of a job,
    each building its share of the files, so that the dataset is whole."""
    for name in dict.fromkeys([name for name, _ in cfg.sources()] + [name for name, _ in cfg.evaluated()]):
        corpus.build_built_in(name, cfg.data_dir)


def tokenizer_for_run(cfg: DataConfig, model_vocab_size: int) -> Tokenizer:
    """The tokenizer, once every split the config reads is known to exist (from its metadata: no text
    is copied): data.tokenizer, or one trained on the train split and cached beside the dataset (in
    data_dir) if none is named. A multi-host job runs this on process 0 first
    (vrl/core/multihost.py), so that a tokenizer is trained once, in the one place every host reads;
    built-in corpora are built before, by every process (`build_built_ins`)."""
    for name, split in [(name, cfg.train_split) for name, _ in cfg.sources()] + list(cfg.evaluated()):
        corpus.split_info(name, cfg.data_dir, split)  # a missing one is a DataError before anything compiles
    return load_tokenizer(cfg, model_vocab_size)


def load_tokenizer(cfg: DataConfig, model_vocab_size: int) -> Tokenizer:
    """data.tokenizer, or one trained on the train split and cached beside the dataset."""
    if cfg.tokenizer:
        tokenizer = Tokenizer.load(cfg.tokenizer)
    else:
        data_dir = cfg.data_dir or layout.default_data_dir()
        names = [name for name, _ in cfg.sources()]
        path = (
            storage.path(data_dir) / 'vrl_tokenizers' / f'{"+".join(names).replace("/", "_")}_{model_vocab_size}.model'
        )
        if path.exists():
            tokenizer = Tokenizer.load(str(path))
        else:
            started = time.monotonic()
            print(
                f'training a {model_vocab_size}-piece tokenizer on {", ".join(names)} (at most '
                f'{cfg.tokenizer_train_docs:,} documents; once, cached at {path}) ...',
                flush=True,
            )
            import sentencepiece

            sentencepiece.set_random_generator_seed(cfg.seed)  # the same model on every host
            per_dataset = -(-cfg.tokenizer_train_docs // len(names))  # a mixture's datasets, equally
            texts = itertools.chain.from_iterable(
                corpus.texts(corpus.open_split(name, cfg.data_dir, cfg.train_split), cfg.text_field, limit=per_dataset)
                for name in names
            )
            tokenizer = train_tokenizer(texts, model_vocab_size, str(path))
            print(f'trained the tokenizer in {time.monotonic() - started:.0f} s', flush=True)
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(
            f'tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but '
            f'model.vocab_size={model_vocab_size}: set --config.model.vocab_size='
            f'{tokenizer.vocab_size} (or larger).'
        )
    return tokenizer


def split_stats(name: str, data_dir: str, tokenizer: Tokenizer | None, text_field: str = 'text') -> dict:
    """Documents, characters and (with a tokenizer) tokens of each split; a terminal shows a bar per split."""
    stats = {}
    for split in ('train', 'validation'):
        docs = chars = tokens = 0
        documents = corpus.split_info(name, data_dir, split).documents
        for text in tqdm.tqdm(
            corpus.texts(corpus.open_split(name, data_dir, split), text_field),
            total=documents,
            desc=f'{name} {split}',
            unit='doc',
            disable=None,
            mininterval=1.0,
            leave=False,
        ):
            docs, chars = docs + 1, chars + len(text)
            tokens += len(tokenizer.encode(text)) if tokenizer else 0
        stats[split] = {'documents': docs, 'characters': chars} | ({'tokens': tokens} if tokenizer else {})
    return stats
