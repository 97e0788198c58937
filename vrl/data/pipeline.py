"""The input pipeline: TFDS source -> tokenize (or a pre-tokenized copy) -> shuffle -> per-process
shard -> pack -> batch.

Built on grain: documents, in blocks of consecutive ones for a corpus of short documents (one
document each for web pages; `_Blocks`), are shuffled globally with a seed (a new order each
epoch), each process takes every `process_count`-th block, worker processes tokenize, and
packing runs in the main process so that batches do not depend on the worker count. The
iterator's state (`get_state` / `set_state`) restores the exact position.

Packing: every document becomes a group `separator + tokens`, separator = [EOS] (+ [BOS] with
`add_bos`), so EOS both ends one document and opens the next; an epoch's stream ends with one
more EOS. Sequences are windows of L + 1 tokens that overlap by one: inputs = stream[i:i+L],
targets = stream[i+1:i+L+1], so every token after the first is a target exactly once. The
last window is padded (loss_mask 0). With `document_masking`, segment ids (1, 2, ... per
window; 0 = padding) and positions restarting at each group keep attention and RoPE within
a document.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, Iterator

import grain
import numpy as np
from absl import flags

from vrl.core import storage
from vrl.core.config import ConfigError, DataConfig
from vrl.data import corpus, tokens
from vrl.data.tokenizer import Tokenizer, TokenizerError
from vrl.data.tokenizer import train as train_tokenizer

Batch = dict[str, np.ndarray]  # inputs, targets, loss_mask [, segment_ids, positions]: (B, L)


BYTES_PER_TOKEN = 4  # a grain element holds about a window of stored text, seq_len * this many bytes (a document at least),
MIN_BLOCKS = 1000  # and a split has at least this many elements where it has the documents (a fine-grained shuffle)


class _Blocks:
    """A split as blocks of consecutive documents, each read at once as a list of token arrays:
    block b holds documents [b R, (b + 1) R). grain spends ~50 us on every element it shuffles,
    shards and prefetches, which bounded a corpus of 50-token documents at ~0.8M tokens/s; R
    documents per element pay it once. R comes from the stored split's bytes per document, so that
    a block holds about one window of text (seq_len tokens of BYTES_PER_TOKEN bytes; a batch then
    draws about as many places in the corpus as it has windows, as a corpus of long documents
    does), and from its size (MIN_BLOCKS): 1 for web pages and small splits. The pre-tokenized and
    on-the-fly readers cut the same blocks. Picklable: grain workers read their own."""

    def __init__(self, text: Any, tokenizer: Tokenizer, text_field: str, pretokenized: tokens.TokenSource | None,
                 seq_len: int):
        self._text, self._tokenizer, self._field, self._pretokenized = text, tokenizer, text_field, pretokenized
        split = text.dataset_info.splits[text.split]
        self.documents = len(text)
        window_bytes = BYTES_PER_TOKEN * seq_len
        self.per_block = max(1, min(window_bytes * split.num_examples // max(split.num_bytes, 1),
                                    self.documents // MIN_BLOCKS))

    def __len__(self) -> int:
        return -(-self.documents // self.per_block)

    def __getitem__(self, block: int) -> list[np.ndarray]:
        documents = range(block * self.per_block, min((block + 1) * self.per_block, self.documents))
        if self._pretokenized is not None:
            return self._pretokenized.documents(documents)
        # array_record reads a list on a thread pool: ~350 us to start, then faster than one by one
        records = self._text.__getitems__(list(documents)) if len(documents) > 16 else [self._text[i] for i in documents]
        texts = [record[self._field] for record in records]
        return self._tokenizer.encode_batch([t.decode('utf-8') if isinstance(t, bytes) else t for t in texts])


class _PackIterator(grain.DatasetIterator):
    """Blocks of documents (each document separator first) joined into windows of L + 1 tokens that
    overlap by one. Each document arrives as a piece and is joined once a window's worth has
    arrived: joining the buffer per document copied it once per document."""

    def __init__(self, parent: grain.DatasetIterator, layout: tuple[int, ...], seq_len: int, separator: np.ndarray,
                 eos_id: int, pad_id: int, document_masking: bool):
        super().__init__(parent)
        self._layout = layout  # documents per element of each dataset: what the parent's position counts
        self._L, self._separator, self._eos, self._pad = seq_len, separator, eos_id, pad_id
        self._document_masking = document_masking
        self._tokens = np.zeros((0,), np.int32)  # stream not yet emitted (the next window's start)
        self._groups = np.zeros((0,), np.int64)  # document group of each buffered token
        self._pieces: list[np.ndarray] = []  # arrived after _tokens, not yet joined to it
        self._piece_groups: list[int] = []
        self._piece_tokens = 0
        self._n_groups = 0
        self._exhausted = False

    def _add(self, tokens: np.ndarray, group: int) -> None:
        self._pieces.append(tokens)
        self._piece_groups.append(group)
        self._piece_tokens += len(tokens)

    def _join(self) -> None:
        if self._pieces:
            lengths = [len(piece) for piece in self._pieces]
            self._tokens = np.concatenate([self._tokens, *self._pieces]).astype(np.int32)
            self._groups = np.concatenate([self._groups, np.repeat(np.asarray(self._piece_groups, np.int64), lengths)])
            self._pieces, self._piece_groups, self._piece_tokens = [], [], 0

    def __next__(self) -> dict[str, np.ndarray]:
        L = self._L
        while len(self._tokens) + self._piece_tokens < L + 1 and not self._exhausted:
            try:
                block = next(self._parent)
            except StopIteration:
                self._exhausted = True
                if self._n_groups:
                    self._add(np.array([self._eos], np.int32), self._n_groups)  # the last document's end
                break
            for doc in block:
                self._n_groups += 1
                self._add(self._separator, self._n_groups)
                self._add(doc, self._n_groups)
        self._join()
        if len(self._tokens) < 2:
            raise StopIteration
        n = min(L + 1, len(self._tokens))
        window, groups = self._tokens[:n], self._groups[:n - 1]
        self._tokens, self._groups = self._tokens[n - 1:], self._groups[n - 1:]
        return _example(window, groups, L, self._pad, self._document_masking)

    def get_state(self) -> dict[str, Any]:  # between windows every piece is joined
        return {'parent': self._parent.get_state(), 'tokens': self._tokens.tolist(),
                'groups': self._groups.tolist(), 'n_groups': self._n_groups, 'exhausted': self._exhausted,
                'documents_per_element': list(self._layout)}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = tuple(state.get('documents_per_element', [1] * len(self._layout)))  # before blocks: one each
        if saved != self._layout:
            raise corpus.DataError(
                f'the saved data position counts grain elements of {list(saved)} documents (per dataset), but this '
                f'pipeline reads {list(self._layout)} (blocks of about a window of text, data.seq_len tokens; vrl read '
                'one document per element before it read blocks): restored, it would land elsewhere in the epoch. '
                'Resume with the vrl version and data.seq_len that saved it, or start a new --workdir from these '
                'weights with --init_from=CHECKPOINT.')
        self._parent.set_state(state['parent'])
        self._tokens = np.asarray(state['tokens'], np.int32)
        self._groups = np.asarray(state['groups'], np.int64)
        self._n_groups, self._exhausted = state['n_groups'], state['exhausted']


def _example(window: np.ndarray, groups: np.ndarray, L: int, pad_id: int,
             document_masking: bool) -> dict[str, np.ndarray]:
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
    def __init__(self, parent: grain.IterDataset, layout: tuple[int, ...], seq_len: int, separator: np.ndarray,
                 eos_id: int, pad_id: int, document_masking: bool):
        super().__init__(parent)
        self._args = (layout, seq_len, separator, eos_id, pad_id, document_masking)

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), *self._args)


def _separator(cfg: DataConfig, tokenizer: Tokenizer) -> np.ndarray:
    return np.array([tokenizer.eos_id] + ([tokenizer.bos_id] if cfg.add_bos else []), np.int32)


def prompt_tokens(cfg: DataConfig, tokenizer: Tokenizer, text: str) -> list[int]:
    """A prompt as the model saw document starts in training: the separator, then the text."""
    return _separator(cfg, tokenizer).tolist() + tokenizer.encode(text).tolist()


def _documents(cfg: DataConfig, tokenizer: Tokenizer, split: str, name: str | None, shuffle: bool,
               num_epochs: int | None) -> tuple[grain.MapDataset, tuple[int, ...]]:
    """The split's documents as token ids, in blocks of consecutive documents (`_Blocks`), and each
    dataset's documents per block: of
    dataset `name`, or of data.sources() mixed by weight (each shuffled with its own seed and
    repeated, then interleaved in the weights' proportions by grain). A dataset's ids come from its
    pre-tokenized copy for this tokenizer when it has one (data.pretokenized), else from tokenizing
    its text; the blocks, and so everything after, are the same either way."""
    sources = [(name, 1.0)] if name else cfg.sources()
    members, block_weights, layout = [], [], []
    for i, (member, weight) in enumerate(sources):
        pretokenized = tokens.find(member, cfg.data_dir, split, tokenizer) if cfg.pretokenized else None
        blocks = _Blocks(corpus.open_split(member, cfg.data_dir, split), tokenizer, cfg.text_field, pretokenized,
                         cfg.seq_len)
        ds = grain.MapDataset.source(blocks)
        members.append((ds.shuffle(seed=cfg.seed + i) if shuffle else ds).repeat(num_epochs))
        block_weights.append(weight * len(blocks) / blocks.documents)  # the weights are in documents
        layout.append(blocks.per_block)
    return (members[0] if len(members) == 1 else grain.MapDataset.mix(members, block_weights)), tuple(layout)


def _pipeline(documents: tuple[grain.MapDataset, tuple[int, ...]], cfg: DataConfig, tokenizer: Tokenizer, *,
              process_index: int, process_count: int) -> grain.IterDataset:
    """Batches of this process's share; a finite pass ends with a padded (loss_mask 0) batch."""
    batch_size = per_process_batch_size(cfg, process_count)
    blocks, layout = documents
    ds = blocks[process_index::process_count].to_iter_dataset(_read_options(cfg))
    if cfg.num_workers:
        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; notebooks never parse them
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers,
                                                         per_worker_buffer_size=max(cfg.prefetch, 1) * 16))
    ds = _PackIterDataset(ds, layout, cfg.seq_len, _separator(cfg, tokenizer), tokenizer.eos_id, tokenizer.pad_id,
                          cfg.document_masking)
    return ds.batch(batch_size).map(functools.partial(_pad_batch, batch_size=batch_size))


def _read_options(cfg: DataConfig) -> grain.ReadOptions:
    """Reading in this process's threads: grain's default 16 threads busy-wait on their futures and
    cost more than the records; data.read_threads > 0 overlaps slow reads (an object store)."""
    return grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=max(cfg.read_threads, 1) * 32)


def per_process_batch_size(cfg: DataConfig, process_count: int) -> int:
    if cfg.batch_size % process_count:
        raise ConfigError(f'data.batch_size={cfg.batch_size} is invalid: allowed a multiple of the '
                         f'process count {process_count}.')
    return cfg.batch_size // process_count


def train_dataset(cfg: DataConfig, tokenizer: Tokenizer, process_index: int = 0,
                  process_count: int = 1) -> grain.IterDataset:
    """Endless (or data.num_epochs) shuffled, packed batches of this process's share of the global
    batch, from data.name or the data.mixture."""
    documents = _documents(cfg, tokenizer, cfg.train_split, None, shuffle=True, num_epochs=cfg.num_epochs or None)
    return _pipeline(documents, cfg, tokenizer, process_index=process_index, process_count=process_count)


def eval_batches(cfg: DataConfig, tokenizer: Tokenizer, max_batches: int, process_index: int = 0,
                 process_count: int = 1, name: str | None = None) -> Iterator[Batch]:
    """The validation split of dataset `name` (default data.name) in a fixed order, one pass,
    every batch full size (padding has loss_mask 0).

    With max_batches > 0 exactly that many batches come (all-padding ones after the split ends),
    so every process runs the same number of eval steps.
    """
    documents = _documents(cfg, tokenizer, cfg.eval_split, name or cfg.name, shuffle=False, num_epochs=1)
    ds = _pipeline(documents, cfg, tokenizer, process_index=process_index, process_count=process_count)
    count = 0
    for batch in ds:
        if max_batches and count == max_batches:
            return
        yield batch
        count += 1
    while max_batches and count < max_batches:
        yield _pad_batch(_empty_like(cfg), per_process_batch_size(cfg, process_count))
        count += 1


def _empty_like(cfg: DataConfig) -> Batch:
    keys = ('inputs', 'targets', 'loss_mask') + (('segment_ids', 'positions') if cfg.document_masking else ())
    return {k: np.zeros((0, cfg.seq_len), np.int32) for k in keys}


def _pad_batch(batch: Batch, batch_size: int) -> Batch:
    missing = batch_size - len(batch['inputs'])
    return {k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)]) if missing else v
            for k, v in batch.items()}


def ready(cfg: DataConfig, model_vocab_size: int) -> Tokenizer:
    """The tokenizer, with every dataset the config reads opened first: a built-in corpus is built and
    a tokenizer trained if none is named, in data_dir. A multi-host job runs this on process 0 first
    (vrl/core/multihost.py), so that those are made once, in the one place every host reads."""
    for name, _ in cfg.sources():
        corpus.open_split(name, cfg.data_dir, cfg.train_split)
    return load_tokenizer(cfg, model_vocab_size)


def load_tokenizer(cfg: DataConfig, model_vocab_size: int) -> Tokenizer:
    """data.tokenizer, or one trained on the train split and cached beside the dataset."""
    if cfg.tokenizer:
        tokenizer = Tokenizer.load(cfg.tokenizer)
    else:
        data_dir = cfg.data_dir or corpus.default_data_dir()
        names = [name for name, _ in cfg.sources()]
        path = storage.path(data_dir) / 'vrl_tokenizers' / f'{"+".join(names).replace("/", "_")}_{model_vocab_size}.model'
        if path.exists():
            tokenizer = Tokenizer.load(str(path))
        else:
            logging.info('training a %d-piece tokenizer on %s (once; cached at %s)', model_vocab_size,
                         ', '.join(names), path)
            import sentencepiece
            sentencepiece.set_random_generator_seed(cfg.seed)  # the same model on every host
            per_dataset = -(-cfg.tokenizer_train_docs // len(names))  # a mixture's datasets, equally
            texts = itertools.chain.from_iterable(
                corpus.texts(corpus.open_split(name, cfg.data_dir, cfg.train_split), cfg.text_field,
                             limit=per_dataset) for name in names)
            tokenizer = train_tokenizer(texts, model_vocab_size, str(path))
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(f'tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but '
                             f'model.vocab_size={model_vocab_size}: set --config.model.vocab_size='
                             f'{tokenizer.vocab_size} (or larger).')
    return tokenizer


def split_stats(name: str, data_dir: str, tokenizer: Tokenizer | None, text_field: str = 'text') -> dict:
    """Documents, characters and (with a tokenizer) tokens of each split."""
    stats = {}
    for split in ('train', 'validation'):
        docs = chars = tokens = 0
        for text in corpus.texts(corpus.open_split(name, data_dir, split), text_field):
            docs, chars = docs + 1, chars + len(text)
            tokens += len(tokenizer.encode(text)) if tokenizer else 0
        stats[split] = {'documents': docs, 'characters': chars} | ({'tokens': tokens} if tokenizer else {})
    return stats
