"""Window shuffling: a pre-tokenized split read in few, large requests (the scheme of Levanter's
block-shuffling dataset and MosaicML streaming's shuffle blocks), for data on an object store.

- The split's documents are cut into I/O blocks of about `block_tokens` tokens: consecutive
  documents of one shard, so a block is one ranged read (`Blocks`).
- Each epoch permutes the blocks by a stateless bijection of the seed and the epoch (grain's index
  shuffle, as `MapDataset.shuffle` over repeated epochs).
- Consecutive permuted blocks form windows of `window_blocks`. The windows of every epoch, one after
  another, are dealt to the processes in turn: process p of P takes windows p, p + P, ..., so no
  two processes read the same block and every block is read once an epoch.
- A window's documents are shuffled together (a generator seeded by the seed and the window's
  number) and handed out in that order, `per_element` documents at a time.
- While a window is handed out, the next one is read, at most `reads` requests in flight; the two
  windows are all that is held.

The position (`get_state`) is this process's window and the documents handed out of it, with the
settings that cut the windows; restoring recomputes the window's order, so a resume goes on exactly
where the run stopped, and a resume with other settings is refused.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import grain
import numpy as np

from vrl.data.sources import DataError

DEFAULT_BLOCK_TOKENS = (
    1 << 18
)  # data.block_tokens=0 (auto): 256K tokens, 512 KB a read at uint16, or a shard if smaller


class Blocks:
    """A split's documents as I/O blocks of `per_block` consecutive documents, none crossing a shard
    (a shard's last block holds what is left of it). `shard_documents`: each shard's documents."""

    def __init__(self, shard_documents: list[int], per_block: int):
        self.per_block = per_block
        self._first_document = np.cumsum([0] + list(shard_documents))
        self._first_block = np.cumsum([0] + [-(-n // per_block) for n in shard_documents])

    def __len__(self) -> int:
        return int(self._first_block[-1])

    def documents(self, block: int) -> range:
        """The documents of block `block`: a range within one shard."""
        shard = int(np.searchsorted(self._first_block, block, side='right')) - 1
        start = int(self._first_document[shard]) + (block - int(self._first_block[shard])) * self.per_block
        return range(start, min(start + self.per_block, int(self._first_document[shard + 1])))


def plan(shard_documents: list[int], tokens: float, block_tokens: int, where: str) -> Blocks:
    """The blocks of a split of `tokens` tokens in shards of `shard_documents` documents, each about
    `block_tokens` tokens (0: DEFAULT_BLOCK_TOKENS, or a shard's tokens if fewer). DataError names
    data.block_tokens when it asks for more than a shard holds. `where`: the split, for messages."""
    documents = sum(shard_documents)
    per_document = tokens / max(documents, 1)
    shard_tokens = int(per_document * max(shard_documents))  # the largest shard's, about
    if block_tokens > shard_tokens:
        raise DataError(
            f'data.block_tokens={block_tokens} is invalid for {where}: a block is read from one shard, and '
            f'its largest holds about {shard_tokens:,} tokens; allowed 0 (auto) or at most {shard_tokens:,}.'
        )
    wanted = block_tokens or min(DEFAULT_BLOCK_TOKENS, shard_tokens)
    return Blocks(shard_documents, max(1, round(wanted / max(per_document, 1e-9))))


class WindowIterator(grain.DatasetIterator):
    """This process's documents in window-shuffled order (see the module's docstring), each element a
    list of `per_element` documents as int32 token arrays. `source.documents(range)` reads
    consecutive documents of one shard (tokens.TokenSource: one ranged read on an object store)."""

    def __init__(
        self,
        source: Any,
        blocks: Blocks,
        *,
        window_blocks: int,
        per_element: int,
        seed: int,
        num_epochs: int | None,
        process_index: int,
        process_count: int,
        reads: int,
        settings: dict,
    ):
        super().__init__()
        self._source, self._blocks, self._W, self._per_element = source, blocks, window_blocks, per_element
        self._seed, self._epochs = seed, num_epochs
        self._process_index, self._process_count = process_index, process_count
        self._settings = settings  # what cuts the windows: a saved position must have been cut the same way
        self._order = grain.MapDataset.range(len(blocks)).shuffle(seed=seed).repeat(None)
        self._windows_per_epoch = -(-len(blocks) // window_blocks)
        self._pool = concurrent.futures.ThreadPoolExecutor(reads, 'vrl-window-read') if reads else None
        self._reading: dict[int, list[Any]] = {}  # this process's window number -> its blocks (futures, or read)
        self._window, self._taken = 0, 0  # the position: this process's window, documents handed out of it
        self._documents: list[np.ndarray] | None = None  # the window being handed out, in shuffled order

    def _global(self, window: int) -> int:
        return self._process_index + window * self._process_count

    def _ends(self, window: int) -> bool:
        return self._epochs is not None and self._global(window) // self._windows_per_epoch >= self._epochs

    def _read(self, window: int) -> list[Any]:
        """The blocks of this process's window `window`, asked for once (read now without a pool)."""
        if window not in self._reading and not self._ends(window):
            epoch, number = divmod(self._global(window), self._windows_per_epoch)
            n = len(self._blocks)
            first = epoch * n + number * self._W
            picks = [self._order[i] % n for i in range(first, min(first + self._W, (epoch + 1) * n))]
            ranges = [self._blocks.documents(int(block)) for block in picks]
            read = self._source.documents
            self._reading[window] = (
                [self._pool.submit(read, r) for r in ranges] if self._pool else [read(r) for r in ranges]
            )
        return self._reading.get(window, [])

    def _open(self) -> None:
        """The current window's documents in shuffled order; the next window's reads started."""
        blocks = self._read(self._window)
        self._read(self._window + 1)  # in flight while this one is handed out
        self._reading.pop(self._window - 1, None)
        documents = [d for block in blocks for d in (block.result() if self._pool else block)]
        order = np.random.default_rng([self._seed, self._global(self._window)]).permutation(len(documents))
        self._documents = [documents[i] for i in order]

    def __next__(self) -> list[np.ndarray]:
        while True:
            if self._ends(self._window):
                raise StopIteration
            if self._documents is None:
                self._open()
            if self._taken < len(self._documents):
                element = self._documents[self._taken : self._taken + self._per_element]
                self._taken += len(element)
                return element
            self._window, self._taken, self._documents = self._window + 1, 0, None

    def get_state(self) -> dict[str, Any]:
        return {'window': self._window, 'taken': self._taken, 'settings': self._settings}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get('settings')
        if saved != self._settings:
            raise DataError(
                f'the saved data position was read in windows cut by {saved}, and this run cuts them by '
                f'{self._settings}: restored, it would land elsewhere in the epoch. Resume with the data.block_tokens '
                'and data.window_blocks that saved it, or start a new --workdir with --init_from=CHECKPOINT.'
            )
        self._reading.clear()
        self._window, self._taken, self._documents = state['window'], state['taken'], None

    def close(self) -> None:
        if self._pool:  # reads not started are dropped; one under way ends on its own
            self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


class WindowDataset(grain.IterDataset):
    """An IterDataset of `WindowIterator`s (the same arguments)."""

    def __init__(self, source: Any, blocks: Blocks, **kwargs: Any):
        super().__init__()
        self._source, self._blocks, self._kwargs = source, blocks, kwargs

    def __iter__(self) -> WindowIterator:
        return WindowIterator(self._source, self._blocks, **self._kwargs)
