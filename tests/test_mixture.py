"""Training on a mixture of datasets (data.mixture), per-domain datasets from JSONL, and per-domain eval."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import assert_resumes_exactly, train_steps
from tests.runs import tiny_config
from vrl.core import sharding
from vrl.core.config import ConfigError
from vrl.data import build, corpus, pipeline
from vrl.data import tokenizer as tokenizer_lib
from vrl.data.config import DataConfig
from vrl.data.tokenizer import EOS_ID
from vrl.train import loop, validation

ALPHA = 'x x x x x x x x x x x x x x x x x x x x x x x x'  # one domain's documents: x runs, then a number
BETA = 'z z z z z z z z z z z z z z z z z z z z z z z ž'  # the other's: z runs (and a 2-byte character)


@pytest.fixture(scope='module')
def domains(tmp_path_factory, small_corpus):
    """Two datasets split from one JSONL file by meta.set: 300 alpha and 120 beta documents."""
    folder = tmp_path_factory.mktemp('mixture')
    records = [{'text': f'{ALPHA} {i}', 'meta': {'set': 'Alpha'}} for i in range(300)] + [
        {'text': f'{BETA} {i}', 'meta': {'set': 'Beta Set'}} for i in range(120)
    ]
    (folder / 'slim.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    names = build.prepare_domains(
        str(folder / 'slim.jsonl'), 'slim', str(folder / 'tfds'), 'meta.set', validation_fraction=0.1
    )
    assert names == {'Alpha': 'slim_alpha', 'Beta Set': 'slim_beta_set'}
    cfg, tokenizer = small_corpus
    cfg = dataclasses.replace(cfg, data_dir=str(folder / 'tfds'), num_epochs=0, mixture='slim_alpha=3,slim_beta_set=1')
    return cfg, tokenizer


def _streams(batches: list[dict]) -> list[np.ndarray]:
    """Each dataset's stream of targets: a row (a window) belongs to the dataset whose count in
    tokens_read it raised, by its targets, and to no other."""
    read = np.concatenate([b['tokens_read'] for b in batches])
    targets = np.concatenate([b['targets'] for b in batches])
    mask = np.concatenate([b['loss_mask'] for b in batches]) == 1
    raised = np.diff(read, axis=0, prepend=np.zeros((1, read.shape[1]), read.dtype))
    assert ((raised > 0).sum(1) == 1).all() and (raised.sum(1) == mask.sum(1)).all()
    source = raised.argmax(1)
    return [targets[source == i][mask[source == i]] for i in range(read.shape[1])]


def _documents(batches: list[dict]) -> list[tuple[int, ...]]:
    """The complete documents among the batches' targets, each dataset's stream split at EOS (the
    unfinished last one dropped, and the first, which may have lost its start to the window)."""
    return [
        tuple(p[:-1])
        for stream in _streams(batches)
        for p in np.split(stream, np.flatnonzero(stream == EOS_ID) + 1)[1:-1]
    ]


def _first_batches(cfg, tokenizer, n, **process) -> list[dict]:
    it = iter(pipeline.train_dataset(cfg, tokenizer, **process))
    return [next(it) for _ in range(n)]


def test_prepare_splits_jsonl_by_domain_each_with_validation(domains):
    cfg, _ = domains
    for name, count in (('slim_alpha', 300), ('slim_beta_set', 120)):
        sizes = {split: len(corpus.open_split(name, cfg.data_dir, split)) for split in ('train', 'validation')}
        assert sum(sizes.values()) == count and abs(sizes['validation'] - count / 10) <= 3 * (count * 0.09) ** 0.5
        text = next(corpus.texts(corpus.open_split(name, cfg.data_dir, 'train')))
        assert text.startswith(ALPHA if name == 'slim_alpha' else BETA)


def _token_shares(batches: list[dict], prefixes: tuple[str, ...], tokenizer) -> list[int]:
    """The target tokens of each dataset in `batches`, each dataset's complete documents starting with
    its prefix (dataset i's with prefixes[i]), and what tokens_read counts in the last row."""
    streams = _streams(batches)
    for i, stream in enumerate(streams):
        documents = np.split(stream, np.flatnonzero(stream == EOS_ID) + 1)[1:-1]
        assert documents and all(tokenizer.decode(d[:-1]).startswith(prefixes[i]) for d in documents)
    counts = [len(stream) for stream in streams]
    assert batches[-1]['tokens_read'][-1].tolist() == counts
    return counts


def test_a_mixture_without_a_tokenizer_trains_one_on_an_equal_share(domains, tmp_path):
    """No data.tokenizer: the tokenizer is trained on the first tokenizer_train_docs / 2 documents of
    each dataset (300 alpha, 120 beta), so beta's own character is a piece of its own; byte for
    byte the tokenizer trained on those documents alone."""
    cfg, _ = domains
    cfg = dataclasses.replace(cfg, tokenizer='', tokenizer_train_docs=40, data_dir=str(tmp_path / 'tfds'))
    shutil.copytree(domains[0].data_dir, cfg.data_dir)
    trained = pipeline.load_tokenizer(cfg, 276)
    assert Path(trained.path) == tmp_path / 'tfds/vrl_tokenizers/slim_alpha+slim_beta_set_276.model'
    assert len(trained.encode('ž')) == 1  # not two byte-fallback pieces: beta's documents were read

    import sentencepiece

    sentencepiece.set_random_generator_seed(cfg.seed)
    shares = [
        corpus.texts(corpus.open_split(name, cfg.data_dir, 'train'), limit=20)
        for name in ('slim_alpha', 'slim_beta_set')
    ]
    by_hand = tokenizer_lib.train(itertools.chain(*shares), 276, str(tmp_path / 'by_hand.model'))
    assert Path(trained.path).read_bytes() == Path(by_hand.path).read_bytes()


def test_tokens_follow_the_weights(domains):
    """alpha=3, beta=1: three quarters of the tokens are alpha's."""
    cfg, tokenizer = domains
    alpha, beta = _token_shares(_first_batches(cfg, tokenizer, 60), (ALPHA, BETA), tokenizer)
    assert alpha / beta == pytest.approx(3, rel=0.05)
    # documents arrive whole and each dataset's are all there is
    texts = [tokenizer.decode(d) for d in _documents(_first_batches(cfg, tokenizer, 20))]
    assert texts and all(t.rsplit(' ', 1)[0] in (ALPHA, BETA) for t in texts)


@pytest.mark.parametrize('pretokenized', [False, True], ids=['on_the_fly', 'pretokenized'])
def test_weights_are_token_shares_whatever_the_document_lengths(domains, tmp_path, pretokenized):
    """Short and 10x longer documents at 1:1 give each half of the tokens (not of the documents)."""
    from vrl.data import tokens

    cfg, tokenizer = domains
    long_text = ' '.join([BETA] * 10)
    records = [{'text': f'{ALPHA} {i}', 'meta': {'set': 'short'}} for i in range(400)] + [
        {'text': f'{long_text} {i}', 'meta': {'set': 'long'}} for i in range(400)
    ]
    (tmp_path / 'lengths.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    data_dir = str(tmp_path / 'tfds')
    build.prepare_domains(
        str(tmp_path / 'lengths.jsonl'),
        'len',
        data_dir,
        'meta.set',
        validation_fraction=0.05,
        tokenizer=tokenizer if pretokenized else None,
    )  # the ids of each domain in the same pass
    if pretokenized:
        assert all(tokens.find(name, data_dir, 'train', tokenizer) for name in ('len_short', 'len_long'))
    mixed = dataclasses.replace(cfg, data_dir=data_dir, mixture='len_short=1,len_long=1', pretokenized=pretokenized)
    short, long = _token_shares(_first_batches(mixed, tokenizer, 80), (ALPHA, BETA), tokenizer)
    assert short / long == pytest.approx(1, rel=0.05)


def test_domains_of_many_files_built_by_a_pool_equal_one_process(tmp_path, capsys):
    """Domains mixed within each of five files: a pool of two processes writes each file's documents
    to its domain's dataset, the same files as one process; done again from the same files it is
    kept, from changed ones refused unless --overwrite, which rebuilds every domain's dataset."""
    raw = tmp_path / 'raw'
    raw.mkdir()
    for f in range(5):
        records = [
            {'text': f'file {f} doc {i} ' * (1 + i % 4), 'meta': {'set': ('web', 'books', 'code')[i % 3]}}
            for i in range(90)
        ]
        (raw / f'part{f}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    built = {
        workers: build.prepare_domains(
            str(raw), 'mix', str(tmp_path / f'tfds{workers}'), 'meta.set', validation_fraction=0.1, workers=workers
        )
        for workers in (1, 2)
    }
    assert built[1] == built[2] == {'books': 'mix_books', 'code': 'mix_code', 'web': 'mix_web'}
    for dataset in built[1].values():
        one, pool = (tmp_path / f'tfds{w}' / dataset / '1.0.0' for w in (1, 2))
        files = sorted(p.name for p in one.iterdir())
        assert files == sorted(p.name for p in pool.iterdir()) and 'vrl_inputs.json' in files
        for name in files:
            if name != 'dataset_info.json':
                assert (one / name).read_bytes() == (pool / name).read_bytes(), (dataset, name)
        texts = [
            t
            for split in ('train', 'validation')
            for t in corpus.texts(corpus.open_split(dataset, str(one.parents[1]), split))
        ]
        assert len(texts) == 150 and all(t.startswith('file ') for t in texts)
    assert not (tmp_path / 'tfds1' / 'mix' / 'vrl_build').exists()
    capsys.readouterr()
    assert (
        build.prepare_domains(str(raw), 'mix', str(tmp_path / 'tfds1'), 'meta.set', validation_fraction=0.1) == built[1]
    )
    assert 'preparing' not in capsys.readouterr().out  # kept
    (raw / 'part4.jsonl').write_text((raw / 'part4.jsonl').read_text().replace('"code"', '"docs"'))
    with pytest.raises(
        corpus.DataError, match=r"'mix' in .* was prepared from other inputs \(the input files' contents"
    ):
        build.prepare_domains(str(raw), 'mix', str(tmp_path / 'tfds1'), 'meta.set', validation_fraction=0.1)
    rebuilt = build.prepare_domains(
        str(raw), 'mix', str(tmp_path / 'tfds1'), 'meta.set', validation_fraction=0.1, overwrite=True
    )
    assert rebuilt == {**built[1], 'docs': 'mix_docs'}


def test_resume_and_process_shards(domains):
    cfg, tokenizer = domains
    k, m = 6, 4
    reference = _first_batches(cfg, tokenizer, k + m)
    assert_resumes_exactly(lambda: pipeline.train_dataset(cfg, tokenizer), reference, k)
    two = dataclasses.replace(cfg, batch_size=16)
    shards = [set(_documents(_first_batches(two, tokenizer, 12, process_index=i, process_count=2))) for i in range(2)]
    assert shards[0] and shards[1] and not shards[0] & shards[1]


@pytest.mark.slow  # trains a run
def test_eval_reports_each_domain_and_their_unweighted_mean(domains, tmp_path):
    cfg, tokenizer = domains
    config = tiny_config(
        (dataclasses.replace(cfg, tokenizer=tokenizer.path), tokenizer), steps=4, checkpoint_every=4, eval_batches=0
    )
    result = loop.run(config, str(tmp_path / 'run'))
    records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    final = [r for r in records if 'eval_loss' in r][-1]
    trainer = train_steps(config, sharding.make_mesh(config.mesh))
    by_hand = {}
    for name in ('slim_alpha', 'slim_beta_set'):  # each validation split alone, as a single-dataset run
        alone = dataclasses.replace(config, data=dataclasses.replace(config.data, mixture='', name=name))
        by_hand[name] = validation.validate(trainer, result.state.params, alone, tokenizer).domains[name]
        assert final[f'eval_loss/{name}'] == pytest.approx(by_hand[name][0], rel=1e-6)
        assert final[f'eval_bpb/{name}'] == pytest.approx(by_hand[name][1], rel=1e-6)
        # bits per byte from the split's own texts: every document's tokens and its EOS are targets
        texts = list(corpus.texts(corpus.open_split(name, cfg.data_dir, 'validation')))
        tokens = sum(len(tokenizer.encode(t)) + 1 for t in texts)
        n_bytes = sum(len(t.encode('utf-8')) for t in texts)
        assert n_bytes > sum(map(len, texts)) or name == 'slim_alpha'  # beta's 'ž' is 2 bytes
        assert final[f'eval_bpb/{name}'] == pytest.approx(by_hand[name][0] * tokens / math.log(2) / n_bytes, rel=1e-5)
    losses = [loss for loss, _ in by_hand.values()]
    assert final['eval_loss'] == pytest.approx(np.mean(losses), rel=1e-6)
    assert final['eval_bpb'] == pytest.approx(np.mean([bpb for _, bpb in by_hand.values()]), rel=1e-6)
    assert final['eval_perplexity'] == pytest.approx(math.exp(np.mean(losses)), rel=1e-6)
    assert abs(losses[0] - losses[1]) > 1e-3  # the domains differ, so the mean is a real average


def test_data_eval_evaluates_the_sets_it_names_each_by_name(domains, tmp_path):
    """Training on one dataset, evaluating on its validation split, another dataset's and its own
    train split (data.eval): each set reported by name, eval_loss their unweighted mean, each equal
    to evaluating that set alone; a set that does not exist is one line before anything compiles."""
    cfg, tokenizer = domains
    base = dataclasses.replace(cfg, tokenizer=tokenizer.path, mixture='', name='slim_alpha')
    config = tiny_config(
        (dataclasses.replace(base, eval='slim_alpha, slim_beta_set, slim_alpha:train'), tokenizer),
        steps=2,
        checkpoint_every=2,
        eval_batches=2,
    )
    result = loop.run(config, str(tmp_path / 'run'))
    records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    final = [r for r in records if 'eval_loss' in r][-1]
    names = ('slim_alpha', 'slim_beta_set', 'slim_alpha:train')
    assert {k for k in final if k.startswith('eval_loss/')} == {f'eval_loss/{n}' for n in names}
    trainer = train_steps(config, sharding.make_mesh(config.mesh))
    for name in names:
        alone = dataclasses.replace(config, data=dataclasses.replace(config.data, eval=name))
        ((loss, _),) = validation.validate(trainer, result.state.params, alone, tokenizer).domains.values()
        assert final[f'eval_loss/{name}'] == pytest.approx(loss, rel=1e-6)
    assert final['eval_loss'] == pytest.approx(np.mean([final[f'eval_loss/{n}'] for n in names]), rel=1e-6)
    with pytest.raises(ConfigError, match=r"data.eval='a,,b' is invalid: .*NAME or NAME:SPLIT"):
        DataConfig(eval='a,,b')
    missing = dataclasses.replace(config, data=dataclasses.replace(config.data, eval='slim_alpha,slim_gamma'))
    with pytest.raises(corpus.DataError, match="TFDS dataset 'slim_gamma'"):
        loop.run(missing, str(tmp_path / 'missing'))


def test_the_run_says_how_far_into_an_epoch_of_each_dataset_it_is(domains, tmp_path, capsys):
    """Each dataset's train tokens (estimated on the fly from 1,000 documents: here within 2% of the
    count) in config.json and the start's log, and at every logged step the target tokens read from
    each (tokens/NAME) and epoch/NAME, those over its train tokens."""
    cfg, tokenizer = domains
    config = tiny_config(
        (dataclasses.replace(cfg, tokenizer=tokenizer.path), tokenizer), steps=3, checkpoint_every=3, log_every=1
    )
    loop.run(config, str(tmp_path / 'run'))
    read = json.loads((tmp_path / 'run' / 'config.json').read_text())['data']['datasets']
    said = capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    step_tokens = config.data.batch_size * config.data.seq_len
    for name, share in (('slim_alpha', 3 / 4), ('slim_beta_set', 1 / 4)):
        texts = corpus.texts(corpus.open_split(name, cfg.data_dir, 'train'))
        counted = sum(len(tokenizer.encode(t)) for t in texts)
        assert read[name]['train_tokens'] == pytest.approx(counted, rel=0.02)
        assert read[name]['train_tokens_are'] == 'estimated from 1,000 documents'
        every = read[name]['train_tokens'] / (step_tokens * share)
        assert (
            f'data {name}: {read[name]["train_tokens"]:,} train tokens (estimated from 1,000 documents, '
            f'tokenized on the fly, shuffled by document): an epoch every {every:,.0f} steps' in said
        )
        for r in (r for r in records if 'loss' in r):  # counted: whole windows in the weights' shares
            assert r[f'tokens/{name}'] == r['step'] * step_tokens * share
            assert r[f'epoch/{name}'] == pytest.approx(r['step'] / every, rel=1e-9)
    assert (
        f'  epoch slim_alpha {3 / (read["slim_alpha"]["train_tokens"] / (step_tokens * 3 / 4)):.2f} slim_beta_set'
        in said
    )


def _windows_per_batch(batches: list[dict]) -> list[tuple[int, ...]]:
    """How many windows of each dataset each batch holds (by the tokens_read count each row raised)."""
    counts, before = [], batches[0]['tokens_read'][:1] * 0
    for b in batches:
        read = np.concatenate([before, b['tokens_read']])
        counts.append(tuple((np.diff(read, axis=0) > 0).sum(0).tolist()))
        before = b['tokens_read'][-1:]
    return counts


def test_a_weight_schedule_changes_the_shares_at_its_step_and_resumes_exactly(domains):
    """alpha=3,beta=1, then 1:1 from step 5, then beta alone from step 9: each batch of 8 windows
    per process holds 6:2, 4:4, then 0:8, on each of two processes; resumed mid-phase from the
    saved state, the batches and the counts go on as if uninterrupted."""
    cfg, tokenizer = domains
    cfg = dataclasses.replace(cfg, mixture_schedule='5:slim_alpha=1,slim_beta_set=1; 9:slim_beta_set=1')
    assert cfg.phases() == [(0, (3.0, 1.0)), (5, (1.0, 1.0)), (9, (0.0, 1.0))]
    want = [(6, 2)] * 5 + [(4, 4)] * 4 + [(0, 8)] * 3
    reference = _first_batches(cfg, tokenizer, 12)
    assert _windows_per_batch(reference) == want
    two = dataclasses.replace(cfg, batch_size=16)
    for index in range(2):
        assert _windows_per_batch(_first_batches(two, tokenizer, 12, process_index=index, process_count=2)) == want
    assert_resumes_exactly(lambda: pipeline.train_dataset(cfg, tokenizer), reference, 7)


def test_bad_mixtures_are_named(domains):
    cfg, tokenizer = domains
    with pytest.raises(ConfigError, match=r"data.mixture='a=0,b=1' is invalid: .*weights > 0.*\('a=0' is not\)"):
        DataConfig(mixture='a=0,b=1')
    with pytest.raises(ConfigError, match='data.num_epochs=1 is invalid: allowed 0 with data.mixture'):
        DataConfig(mixture='a=1', num_epochs=1)
    for schedule, named in (
        ('5:a=1;5:b=1', "'5:b=1' is not"),
        ('x:a=1', "'x:a=1' is not"),
        ('5:c=1', "naming only data.mixture's datasets \\(a, b\\)"),
        ('5:a=0', "'5:a=0' is not"),
        ('5:a=-1', "'a=-1' is not"),
    ):
        with pytest.raises(ConfigError, match=f'data.mixture_schedule=.* is invalid: .*{named}'):
            DataConfig(mixture='a=1,b=1', mixture_schedule=schedule)
    with pytest.raises(ConfigError, match="data.mixture_schedule='5:a=1' is invalid: allowed '' without data.mixture"):
        DataConfig(mixture_schedule='5:a=1')
    missing = dataclasses.replace(cfg, mixture='slim_alpha=1,slim_gamma=1')
    with pytest.raises(corpus.DataError, match='slim_gamma'):
        next(iter(pipeline.train_dataset(missing, tokenizer)))
