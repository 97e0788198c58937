"""Window shuffling (vrl/data/windows.py): a pre-tokenized split read in whole I/O blocks, permuted
each epoch and shuffled within windows, each process taking whole windows. Exact and deterministic:
every document once an epoch, shares disjoint, the same batches whatever the read threads, and a
resume that goes on bit for bit."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import assert_resumes_exactly
from vrl.core.config import ConfigError
from vrl.data import corpus, pipeline, tokens, windows
from vrl.data.config import DataConfig
from vrl.data.sources import DataError


@pytest.fixture(scope='module')
def windowed(small_corpus, tmp_path_factory) -> tuple[DataConfig, tokens.TokenSource]:
    """The four plays pre-tokenized (16 shards), read in windows of 4 blocks of ~600 tokens."""
    cfg, tokenizer = small_corpus
    data_dir = tmp_path_factory.mktemp('windows')
    shutil.copytree(Path(cfg.data_dir) / 'plays', data_dir / 'plays')
    tokens.tokenize('plays', str(data_dir), tokenizer, workers=1)
    cfg = dataclasses.replace(
        cfg,
        data_dir=str(data_dir),
        shuffle='windows',
        block_tokens=600,
        window_blocks=4,
        num_epochs=0,
        read_threads=0,
        seed=3,
    )
    return cfg, tokens.find('plays', cfg.data_dir, 'train', tokenizer)


class _Numbered:
    """A split whose document i is [i], in the real source's shards: what a window holds is legible."""

    def __init__(self, source: tokens.TokenSource):
        self.shard_documents, self._tokens = source.shard_documents, source.token_count()
        self.reads: list[range] = []

    def token_count(self) -> float:
        return self._tokens

    def documents(self, indices: range) -> list[np.ndarray]:
        self.reads.append(indices)
        return [np.array([i]) for i in indices]


def _window_iterator(cfg: DataConfig, source, process_index=0, process_count=1, epochs=None, reads=0, per_element=3):
    blocks = windows.plan(source.shard_documents, source.token_count(), cfg.block_tokens, 'plays train')
    return windows.WindowIterator(
        source,
        blocks,
        window_blocks=cfg.window_blocks,
        per_element=per_element,
        seed=cfg.seed,
        num_epochs=epochs,
        process_index=process_index,
        process_count=process_count,
        reads=reads,
        settings={'block_documents': blocks.per_block},
    )


def test_blocks_are_consecutive_documents_of_one_shard_near_the_asked_size(windowed):
    cfg, source = windowed
    blocks = windows.plan(source.shard_documents, source.token_count(), cfg.block_tokens, 'plays train')
    shard_ends = set(np.cumsum(source.shard_documents).tolist())
    covered = []
    for b in range(len(blocks)):
        r = blocks.documents(b)
        assert len(r) >= 1 and not any(start in shard_ends for start in range(r.start + 1, r.stop))  # never across
        covered += list(r)
    assert covered == list(range(len(source)))
    sizes = [sum(len(d) for d in source.documents(blocks.documents(b))) for b in range(len(blocks))]
    assert 300 < np.median(sizes) < 1200, np.median(sizes)  # about 600 tokens each
    assert len(blocks) > 4 * len(source.shard_documents)


@pytest.mark.parametrize('process_count', [1, 2, 3])
def test_every_document_once_an_epoch_and_the_processes_shares_disjoint(windowed, process_count):
    """Over two epochs the processes' windows together hold every document once an epoch, no
    block is read by two processes, and each block is one read."""
    cfg, real = windowed
    sources = [_Numbered(real) for _ in range(process_count)]
    streams = [
        [
            [int(d[0]) for d in window]
            for window in _window_iterator(cfg, source, p, process_count, epochs=2, per_element=10**6, reads=2)
        ]
        for p, source in enumerate(sources)
    ]
    read = collections.Counter(d for stream in streams for window in stream for d in window)
    assert read == collections.Counter({d: 2 for d in range(len(real))})
    sizes = [len(stream) for stream in streams]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    blocks = windows.plan(real.shard_documents, real.token_count(), cfg.block_tokens, 'plays train')
    reads = [r for source in sources for r in source.reads]
    assert sorted((r.start, r.stop) for r in reads) == sorted(
        (r.start, r.stop) for r in map(blocks.documents, range(len(blocks))) for _ in range(2)
    )
    one = [int(d[0]) for window in _window_iterator(cfg, _Numbered(real), epochs=1) for d in window]
    assert sorted(one) == list(range(len(real))) and one != sorted(one)
    again = [
        int(d[0])
        for window in _window_iterator(dataclasses.replace(cfg, seed=4), _Numbered(real), epochs=1)
        for d in window
    ]
    assert again != one  # another seed, another order


def test_a_window_holds_its_blocks_documents_shuffled_and_the_next_epoch_reorders(windowed):
    """With elements larger than a window, each element is one window: the documents of
    window_blocks whole blocks, shuffled; the second epoch's first window is of other blocks."""
    cfg, real = windowed
    blocks = windows.plan(real.shard_documents, real.token_count(), cfg.block_tokens, 'plays train')
    per_epoch = -(-len(blocks) // cfg.window_blocks)
    window_list = list(_window_iterator(cfg, _Numbered(real), epochs=2, per_element=10**6))
    assert len(window_list) == 2 * per_epoch
    block_of = {i: b for b in range(len(blocks)) for i in blocks.documents(b)}
    firsts = []
    for window in (window_list[0], window_list[per_epoch]):
        positions = [int(d[0]) for d in window]
        held = {block_of[i] for i in positions}
        assert len(held) == cfg.window_blocks and sorted(positions) == sorted(
            i for b in held for i in blocks.documents(b)
        )
        assert positions != sorted(positions)  # shuffled within the window
        firsts.append(held)
    assert firsts[0] != firsts[1]


def test_batches_are_the_same_for_0_8_and_64_read_threads_and_resume_bit_for_bit(windowed, small_corpus):
    cfg, _ = windowed
    _, tokenizer = small_corpus
    cfg = dataclasses.replace(cfg, document_masking=True)
    expected = list(itertools.islice(pipeline.train_dataset(cfg, tokenizer), 40))
    for threads in (8, 64):
        got = list(
            itertools.islice(pipeline.train_dataset(dataclasses.replace(cfg, read_threads=threads), tokenizer), 40)
        )
        for a, b in zip(got, expected, strict=True):
            assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert_resumes_exactly(
        lambda: pipeline.train_dataset(dataclasses.replace(cfg, read_threads=8), tokenizer), expected, 13
    )  # past the first window


def test_a_mixture_with_a_weight_schedule_resumes_bit_for_bit_in_windows(windowed, small_corpus, tmp_path):
    cfg, _ = windowed
    _, tokenizer = small_corpus
    for name in ('left', 'right'):  # two datasets: the plays twice, under two names
        shutil.copytree(Path(cfg.data_dir) / 'plays', tmp_path / name)
    cfg = dataclasses.replace(
        cfg, data_dir=str(tmp_path), mixture='left=3,right=1', mixture_schedule='4:left=1,right=1', name='left'
    )
    whole = list(itertools.islice(pipeline.train_dataset(cfg, tokenizer), 16))
    assert_resumes_exactly(lambda: pipeline.train_dataset(cfg, tokenizer), whole, 6)
    read = whole[-1]['tokens_read'][-1]
    assert read[0] > read[1] > 0


def test_bad_window_settings_are_one_line_naming_the_field(windowed, small_corpus):
    cfg, source = windowed
    _, tokenizer = small_corpus
    with pytest.raises(DataError, match=r'^data.block_tokens=1000000 is invalid for plays train: .* at most [\d,]+\.$'):
        next(iter(pipeline.train_dataset(dataclasses.replace(cfg, block_tokens=1_000_000), tokenizer)))
    with pytest.raises(ConfigError, match='data.window_blocks'):
        DataConfig(window_blocks=0)
    with pytest.raises(ConfigError, match="data.shuffle.*'auto', 'documents', 'windows'"):
        DataConfig(shuffle='blocks')
    with pytest.raises(DataError, match=r"data.shuffle='windows' reads a pre-tokenized copy.*plays train"):
        pipeline.train_dataset(dataclasses.replace(cfg, pretokenized=False), tokenizer)
    saved = iter(pipeline.train_dataset(cfg, tokenizer))
    next(saved)
    state = json.loads(json.dumps(saved.get_state()))
    for other, field in (
        (dict(window_blocks=8), 'data.window_blocks'),
        (dict(block_tokens=300), 'data.block_tokens'),
        (dict(shuffle='documents'), 'data.shuffle'),
    ):
        with pytest.raises(DataError, match=field):
            iter(pipeline.train_dataset(dataclasses.replace(cfg, **other), tokenizer)).set_state(state)


def test_auto_shuffles_in_windows_only_a_pretokenized_copy_on_a_store(windowed, small_corpus):
    cfg, _ = windowed
    _, tokenizer = small_corpus
    auto = dataclasses.replace(cfg, shuffle='auto')
    blocks = pipeline._blocks(auto, tokenizer, 'plays', 'train')
    assert not pipeline._window_shuffled(auto, blocks.source, 'plays train')  # local disk: the global document shuffle
    assert pipeline._window_shuffled(
        dataclasses.replace(auto, data_dir='gs://bucket/tfds'), blocks.source, 'plays train'
    )
    on_the_fly = pipeline._blocks(dataclasses.replace(auto, pretokenized=False), tokenizer, 'plays', 'train')
    assert not pipeline._window_shuffled(
        dataclasses.replace(auto, data_dir='gs://bucket/tfds'), on_the_fly.source, 'plays train'
    )
    assert corpus.split_info('plays', cfg.data_dir, 'train').documents == blocks.documents


def test_settings_that_do_nothing_in_this_run_are_noted_in_one_line_each():
    """data.block_tokens / window_blocks where every dataset is read by document, and a local window
    at least as long as the sequence: a note each (the run still starts); nothing where they act."""
    from vrl.model.config import ModelConfig
    from vrl.train import plan
    from vrl.train.config import Config

    by_document = {'plays': {'shuffle': 'by document'}}
    in_windows = {'plays': {'shuffle': 'in windows of 64 blocks of ~1,000 tokens'}}
    config = Config(
        model=ModelConfig(attention_window=100_000),
        data=DataConfig(name='plays', seq_len=128, block_tokens=100_000_000),
    )
    assert plan.idle_settings(config, by_document) == [
        'note: data.block_tokens=100000000 does nothing here: the training data is read by document '
        "(data.shuffle='auto'; 'auto' reads windows of blocks from an object store only, 'windows' everywhere)",
        'note: model.attention_window=100000 covers the whole sequence (data.seq_len=128): every layer attends '
        'to all positions in this run; local layers differ at longer sequences only',
    ]
    acting = Config(model=ModelConfig(attention_window=64), data=DataConfig(name='plays', seq_len=128, block_tokens=9))
    assert plan.idle_settings(acting, in_windows) == [] and plan.idle_settings(Config(), by_document) == []
