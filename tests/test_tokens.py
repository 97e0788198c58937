"""The paper's data at pod speed: Hugging Face tokenizer.json tokenizers, parquet / .jsonl.gz /
.jsonl.zst inputs streamed, and pre-tokenized datasets read by the same pipeline."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import assert_resumes_exactly
from vrl.data import build, corpus, pipeline, shards, sources, tokens
from vrl.data.tokenizer import EOS_ID, HuggingFaceTokenizer, Tokenizer, TokenizerError
from vrl.data.tokenizer import train as train_tokenizer

TEXT = 'ROMEO: What say 東京🎭 café?\n\n  Thou art\tthere, 12345.'


@pytest.fixture(scope='module')
def hf_tokenizer(small_corpus, tmp_path_factory) -> HuggingFaceTokenizer:
    cfg, _ = small_corpus
    texts = corpus.texts(corpus.open_split('plays', cfg.data_dir, 'train'))
    tok = train_tokenizer(itertools.chain(texts, [TEXT]), 600, str(tmp_path_factory.mktemp('hf') / 'tokenizer.json'))
    assert isinstance(tok, HuggingFaceTokenizer)
    return tok


def test_a_trained_tokenizer_json_is_exact_on_any_text(hf_tokenizer, small_corpus):
    tok = hf_tokenizer
    assert (tok.eos_id, tok.pad_id) == (EOS_ID, 0) and tok.vocab_size <= 600
    cfg, _ = small_corpus
    texts = [TEXT] + list(itertools.islice(corpus.texts(corpus.open_split('plays', cfg.data_dir, 'validation')), 50))
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        ((counted, n_bytes),) = tok.encode_counting_bytes([text])
        assert counted.tolist() == ids.tolist() and n_bytes.sum() == len(text.encode('utf-8'))  # exact bits per byte
    context, continuation = 'ROMEO: What', ' say 東京'
    first, second = tok.encode_pair(context, continuation)
    assert first + second == tok.encode(context + continuation).tolist() and second
    assert tok.decode(second).endswith('東京')
    again = Tokenizer.load(tok.path)
    assert again.difference(tok) is None and again.fingerprint == tok.fingerprint
    import pickle

    assert (pickle.loads(pickle.dumps(tok)).encode(TEXT) == tok.encode(TEXT)).all()


def test_special_tokens_come_from_the_config_beside_or_their_usual_names(hf_tokenizer, tmp_path):
    rust = json.loads(hf_tokenizer.file_bytes)
    renamed = {'</s>': '<|endoftext|>', '<pad>': '<|padding|>'}  # GPT-NeoX's names
    for token in rust['added_tokens']:
        token['content'] = renamed.get(token['content'], token['content'])
    rust['model']['vocab'] = {renamed.get(piece, piece): i for piece, i in rust['model']['vocab'].items()}
    (tmp_path / 'neox').mkdir()
    (tmp_path / 'neox' / 'tokenizer.json').write_text(json.dumps(rust))
    neox = Tokenizer.load(str(tmp_path / 'neox' / 'tokenizer.json'))
    assert (neox.eos_id, neox.pad_id, neox.bos_id) == (1, 0, 2)
    (tmp_path / 'neox' / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<s>', 'pad_token': None}))
    assert Tokenizer.load(str(tmp_path / 'neox' / 'tokenizer.json')).eos_id == 2
    # a model directory, as transformers reads it: special_tokens_map.json overrides the config's names
    (tmp_path / 'neox' / 'special_tokens_map.json').write_text(
        json.dumps({'eos_token': {'content': '<|endoftext|>'}, 'pad_token': '<|padding|>'})
    )
    directory = Tokenizer.load(str(tmp_path / 'neox'))
    assert directory.path == str(tmp_path / 'neox' / 'tokenizer.json') and (directory.eos_id, directory.pad_id) == (
        1,
        0,
    )
    transformers = pytest.importorskip('transformers')
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'neox'))
    assert (theirs.eos_token_id, theirs.pad_token_id) == (directory.eos_id, directory.pad_id)
    (tmp_path / 'neox' / 'tokenizer_config.json').write_text(
        json.dumps({'eos_token': '<s>', 'added_tokens_decoder': {}})
    )  # the map is legacy then, as transformers has it
    assert Tokenizer.load(str(tmp_path / 'neox')).eos_id == 2
    (tmp_path / 'empty_model_dir').mkdir()
    with pytest.raises(
        TokenizerError,
        match=r"folder '.*empty_model_dir' holds neither tokenizer.json nor "
        r'tokenizer.model',
    ):
        Tokenizer.load(str(tmp_path / 'empty_model_dir'))
    rust['added_tokens'] = [
        dict(t, special=False) if t['content'] == '<|endoftext|>' else t for t in rust['added_tokens']
    ]
    (tmp_path / 'bare.json').write_text(json.dumps(rust))
    with pytest.raises(TokenizerError, match=r'bare.json: no EOS token \(special tokens: .*tokenizer_config.json'):
        Tokenizer.load(str(tmp_path / 'bare.json'))
    (tmp_path / 'broken.json').write_text('{"model": 1}')
    with pytest.raises(TokenizerError, match=r"broken.json' is not a Hugging Face tokenizer.json"):
        Tokenizer.load(str(tmp_path / 'broken.json'))


def test_the_exported_tokenizer_json_encodes_as_the_run_did_in_transformers(hf_tokenizer, small_corpus, tmp_path):
    transformers = pytest.importorskip('transformers')
    from vrl.interop import hf

    hf.write_tokenizer(hf_tokenizer, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    cfg, _ = small_corpus
    literal = TEXT + ' '.join(_special_texts(hf_tokenizer))  # special tokens' text inside a document
    assert theirs(literal).input_ids == pipeline.prompt_tokens(cfg, hf_tokenizer, literal)
    assert Tokenizer.load(str(tmp_path / 'tokenizer.json')).difference(hf_tokenizer) is None
    assert hf.run_tokenizer(str(tmp_path), '') == (
        str(tmp_path / 'tokenizer.json'),
        f'tokenizer {tmp_path / "tokenizer.json"}',
    )


def _records(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    words = ['thou', 'art', '東京', 'café', 'the', 'king', '🎭', 'say']
    return [
        {'text': ' '.join(rng.choice(words, rng.integers(5, 40))) + f' {i}', 'meta': {'set': 'ab'[i % 2]}}
        for i in range(n)
    ]


def test_jsonl_ndjson_gz_zst_and_parquet_are_read_as_plain_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = _records(60)
    lines = ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in records).encode()
    inputs = {
        'jsonl': lines,
        'ndjson': lines,
        'jsonl.gz': gzip.compress(lines),
        'jsonl.zst': zstandard.ZstdCompressor().compress(lines),
    }
    for ending, payload in inputs.items():
        (tmp_path / ending).mkdir()
        (tmp_path / ending / f'part.{ending}').write_bytes(payload)
    (tmp_path / 'parquet').mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / 'parquet' / 'part.parquet', row_group_size=16)
    got = {}
    for kind in ('jsonl', 'ndjson', 'jsonl.gz', 'jsonl.zst', 'parquet'):
        name = 'c_' + kind.replace('.', '_')
        build.prepare_from_glob(str(tmp_path / kind), name, str(tmp_path / 'tfds'), validation_fraction=0.2)
        got[kind] = {
            split: sorted(corpus.texts(corpus.open_split(name, str(tmp_path / 'tfds'), split)))
            for split in ('train', 'validation')
        }
    assert sorted(got['jsonl']['train'] + got['jsonl']['validation']) == sorted(r['text'] for r in records)
    for kind, splits in got.items():  # the held-out documents follow the file's name (and the chance of 0.2)
        assert sorted(splits['train'] + splits['validation']) == sorted(
            got['jsonl']['train'] + got['jsonl']['validation']
        )
        assert 3 <= len(splits['validation']) <= 21, kind  # 12 +- 3 sigma
    domains = build.prepare_domains(
        str(tmp_path / 'parquet'), 'dom', str(tmp_path / 'tfds'), 'meta.set', validation_fraction=0.2
    )
    assert domains == {'a': 'dom_a', 'b': 'dom_b'}


def test_bad_corpus_files_are_one_line_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    whole = zstandard.ZstdCompressor().compress(b''.join(json.dumps(r).encode() + b'\n' for r in _records(400)))
    (tmp_path / 'cut').mkdir()
    (tmp_path / 'cut' / 'part.jsonl.zst').write_bytes(whole[: len(whole) // 2])
    with pytest.raises(corpus.DataError, match=r'part.jsonl.zst cannot be read as JSON lines: .*Fetch it again'):
        build.prepare_from_glob(str(tmp_path / 'cut'), 'cut', str(tmp_path / 'tfds'))
    (tmp_path / 'cols').mkdir()
    pq.write_table(pa.Table.from_pylist([{'body': 'x'}]), tmp_path / 'cols' / 'p.parquet')
    with pytest.raises(
        corpus.DataError, match=r"p.parquet has no column 'text' \(columns: \['body'\]\); .*--text_field"
    ):
        build.prepare_from_glob(str(tmp_path / 'cols'), 'cols', str(tmp_path / 'tfds'))
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'empty' / 'e.jsonl').write_text('{"text": ""}\n{"text": "  "}\n')
    with pytest.raises(corpus.DataError, match=r'no non-empty documents in 1 input file\(s\): .*e.jsonl'):
        build.prepare_from_glob(str(tmp_path / 'empty'), 'empty', str(tmp_path / 'tfds'))
    assert not list((tmp_path / 'tfds').glob('*/*/dataset_info.json'))  # nothing left as if complete


def test_blank_line_blocks_are_the_same_read_a_chunk_at_a_time():
    import io
    import re

    rng = np.random.default_rng(1)
    text = ''.join(rng.choice(['a', 'b ', '\n', '\n\n', '\n \t\n', '\r\n\r\n', 'é'], 3000))
    for chunk in (1, 2, 3, 7, 64):
        assert list(sources._blank_line_blocks(io.StringIO(text), chunk)) == re.split(r'\n[ \t\r]*\n', text)


@pytest.fixture(scope='module')
def pretokenized(small_corpus, hf_tokenizer, tmp_path_factory):
    """The plays dataset copied to a folder of its own and pre-tokenized there by the tokenizer.json."""
    cfg, _ = small_corpus
    data_dir = tmp_path_factory.mktemp('pretokenized')
    shutil.copytree(Path(cfg.data_dir) / 'plays', data_dir / 'plays')
    folder = tokens.tokenize('plays', str(data_dir), hf_tokenizer, workers=2)
    return dataclasses.replace(cfg, data_dir=str(data_dir), tokenizer=hf_tokenizer.path), folder


BLOCKS = pytest.mark.parametrize(
    'min_blocks, bytes_per_token', [(1 << 40, 4), (8, 128)], ids=['one_document_each', 'blocks']
)


def _blocks(monkeypatch, min_blocks: int, bytes_per_token: int) -> None:
    monkeypatch.setattr(pipeline, 'MIN_BLOCKS', min_blocks)
    monkeypatch.setattr(pipeline, 'BYTES_PER_TOKEN', bytes_per_token)


@BLOCKS
@pytest.mark.parametrize('process_count, document_masking', [(1, True), (2, False)])
def test_pretokenized_batches_equal_tokenizing_on_the_fly(
    pretokenized, hf_tokenizer, caplog, process_count, document_masking, min_blocks, bytes_per_token, monkeypatch
):
    """Batch for batch, over 2 epochs, in each process; with one document per grain element and
    in blocks of consecutive documents (a corpus of short documents; here ~50)."""
    _blocks(monkeypatch, min_blocks, bytes_per_token)
    cfg, folder = pretokenized
    per_block = pipeline._Blocks(
        None, corpus.split_info('plays', cfg.data_dir, 'train'), cfg.seq_len, 'train'
    ).per_block
    assert (per_block == 1) == (min_blocks > 1000) and per_block < 100
    cfg = dataclasses.replace(cfg, document_masking=document_masking, num_epochs=2)
    with caplog.at_level(logging.INFO):
        fast = [list(pipeline.train_dataset(cfg, hf_tokenizer, i, process_count)) for i in range(process_count)]
    assert f'plays train: pre-tokenized by {hf_tokenizer.path}' in caplog.text and str(folder) in caplog.text
    slow = [
        list(pipeline.train_dataset(dataclasses.replace(cfg, pretokenized=False), hf_tokenizer, i, process_count))
        for i in range(process_count)
    ]
    assert len(fast[0]) > 4
    for a, b in zip(itertools.chain(*fast), itertools.chain(*slow), strict=True):
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    evaluated = list(pipeline.eval_batches(cfg, hf_tokenizer, 0))
    on_the_fly = list(pipeline.eval_batches(dataclasses.replace(cfg, pretokenized=False), hf_tokenizer, 0))
    assert all((a['inputs'] == b['inputs']).all() for a, b in zip(evaluated, on_the_fly, strict=True))


def test_each_split_is_tokenized_into_at_least_16_shards_or_one_a_document(pretokenized):
    """The shard plan depends on no worker count: max(16, documents / DOCUMENTS_PER_SHARD) shards, no
    more than the split has documents, each a contiguous run of them."""
    cfg, folder = pretokenized
    info = json.loads((Path(folder) / tokens.MARKER).read_text())
    assert info['splits']['train']['documents'] > 16  # a split whose plan is the minimum, not one a document
    for split, planned in info['splits'].items():
        documents = corpus.split_info('plays', cfg.data_dir, split).documents
        assert len(planned['shards']) == min(documents, 16), (split, documents)
        assert sum(planned['shard_documents']) == documents and min(planned['shard_documents']) >= 1


def test_a_vocabulary_of_up_to_65536_pieces_is_stored_in_uint16():
    """Ids 0..65535 fit two bytes: exactly 2^16 pieces is the largest vocabulary stored in uint16."""
    assert shards.dtype_for(1 << 16) == np.dtype('<u2') and shards.dtype_for((1 << 16) + 1) == np.dtype('<u4')
    assert shards.dtype_for(32_000) == np.dtype('<u2')
    assert np.array([(1 << 16) - 1], np.int64).astype(shards.dtype_for(1 << 16))[0] == (1 << 16) - 1


def test_a_vocabulary_above_65536_pieces_is_stored_in_uint32(small_corpus, hf_tokenizer, tmp_path):
    """The tokenizer.json with 2^16 filler pieces before its own (specials keep their ids), so every
    ordinary id is above what uint16 holds: the shards are uint32 and read back as tokenizing does."""
    rust = json.loads(Path(hf_tokenizer.path).read_text())
    specials = {t['content'] for t in rust['added_tokens']}
    vocab = rust['model']['vocab']
    n_special = len(specials)
    assert sorted(vocab[p] for p in specials) == list(range(n_special))  # the trainer puts them first
    shift = 1 << 16
    rust['model']['vocab'] = {
        **{p: i if p in specials else i + shift for p, i in vocab.items()},
        **{f'<filler{k}>': k for k in range(n_special, n_special + shift)},
    }
    (tmp_path / 'big.json').write_text(json.dumps(rust))
    big = Tokenizer.load(str(tmp_path / 'big.json'))
    assert big.vocab_size > shift and min(big.encode(TEXT)) >= shift
    cfg, _ = small_corpus
    data_dir = tmp_path / 'tfds'
    shutil.copytree(Path(cfg.data_dir) / 'plays', data_dir / 'plays')
    folder = tokens.tokenize('plays', str(data_dir), big, workers=1)
    assert shards.dtype_for(big.vocab_size) == np.dtype('<u4')
    assert json.loads((Path(folder) / 'tokens.json').read_text())['dtype'] == '<u4'
    cfg = dataclasses.replace(cfg, data_dir=str(data_dir), tokenizer=big.path, num_epochs=1)
    fast = list(pipeline.train_dataset(cfg, big, 0, 1))
    slow = list(pipeline.train_dataset(dataclasses.replace(cfg, pretokenized=False), big, 0, 1))
    assert max(int(b['inputs'].max()) for b in fast) >= shift
    for a, b in zip(fast, slow, strict=True):
        assert all((a[k] == b[k]).all() for k in a)


@BLOCKS
def test_a_pretokenized_iterator_resumes_exactly(pretokenized, hf_tokenizer, min_blocks, bytes_per_token, monkeypatch):
    _blocks(monkeypatch, min_blocks, bytes_per_token)
    cfg, _ = pretokenized
    cfg = dataclasses.replace(cfg, num_epochs=0, document_masking=True)
    whole = iter(pipeline.train_dataset(cfg, hf_tokenizer))
    expected = [next(whole) for _ in range(12)]
    assert_resumes_exactly(lambda: pipeline.train_dataset(cfg, hf_tokenizer), expected, 5)


def test_tokenize_resumes_from_the_shards_it_finished_and_checks_the_dataset(
    pretokenized, hf_tokenizer, caplog, tmp_path
):
    cfg, folder = pretokenized
    data_dir = tmp_path / 'copy'
    shutil.copytree(Path(cfg.data_dir), data_dir)
    copy = Path(str(folder).replace(cfg.data_dir, str(data_dir)))
    info = json.loads((copy / tokens.MARKER).read_text())
    shard = info['splits']['train']['shards'][1]
    before = (copy / f'{shard}.tokens').read_bytes()
    for name in (tokens.MARKER, f'{shard}.offsets.npy', f'{shard}.tokens'):
        os.remove(copy / name)  # killed while writing this shard
    (copy / f'{shard}.tokens.partial').write_bytes(b'half')
    with caplog.at_level(logging.INFO):
        tokens.tokenize('plays', str(data_dir), hf_tokenizer, workers=1)
    total = sum(len(s['shards']) for s in info['splits'].values())
    assert f'1 of {total} shards to write here ({total - 1} done before)' in caplog.text
    assert (copy / f'{shard}.tokens').read_bytes() == before and json.loads((copy / tokens.MARKER).read_text()) == info
    assert info['dataset_fingerprint'] == corpus.fingerprint('plays', str(data_dir)) and info['text_field'] == 'text'
    documents = info['splits']['train']['documents']
    for field, value, why in [
        ('documents', documents + 1, f'{documents + 1} documents then, {documents} now'),
        ('dataset_fingerprint', '0' * 16, 'the dataset was prepared again from other inputs'),
        ('text_field', 'body', "its text field was 'body', data.text_field is 'text'"),
    ]:
        stale = json.loads(json.dumps(info))
        (stale['splits']['train'] if field == 'documents' else stale)[field] = value
        (copy / tokens.MARKER).write_text(json.dumps(stale))
        with pytest.raises(
            corpus.DataError,
            match=rf"{copy} was made from other text than dataset 'plays' holds "
            rf'now \({re.escape(why)}.*--overwrite',
        ):
            tokens.find('plays', str(data_dir), 'train', hf_tokenizer)


def test_a_dataset_pretokenized_only_by_another_tokenizer_is_refused_before_anything_compiles(
    pretokenized, small_corpus, tmp_path, capsys
):
    """The config names a tokenizer without a copy while another's copy is there: one line naming
    the copies and the ways on, before the run resolves (compiles) anything; data.pretokenized=false
    trains on the fly."""
    from tests.runs import tiny_config
    from vrl.train import loop

    cfg, folder = pretokenized
    _, sentencepiece = small_corpus
    with pytest.raises(
        corpus.DataError,
        match=rf"dataset 'plays' is pre-tokenized only by other tokenizers than "
        rf'{re.escape(sentencepiece.path)} \({re.escape(str(folder))};',
    ):
        tokens.find('plays', cfg.data_dir, 'train', sentencepiece)
    config = tiny_config(small_corpus, steps=1, checkpoint_every=1)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, data_dir=cfg.data_dir))
    with pytest.raises(corpus.DataError, match='data.pretokenized=false'):
        loop.run(config, str(tmp_path / 'refused'))
    assert 'model.attention_impl' not in capsys.readouterr().out  # resolve (which may compile) never ran
    on_the_fly = dataclasses.replace(config, data=dataclasses.replace(config.data, pretokenized=False))
    assert len(loop.run(on_the_fly, str(tmp_path / 'on_the_fly')).losses) == 1


def test_held_offsets_keep_the_most_recently_used_within_their_limit():
    held = shards._HeldOffsets(limit=200)
    arrays = {key: np.arange(10, dtype=np.int64) + i for i, key in enumerate('abc')}  # 80 bytes each
    held.put('a', arrays['a'])
    held.put('b', arrays['b'])
    assert (held.get('a') == arrays['a']).all()  # now the most recent
    held.put('c', arrays['c'])
    assert held.get('b') is None and (held.get('a') == arrays['a']).all() and (held.get('c') == arrays['c']).all()


def _special_texts(tok: HuggingFaceTokenizer) -> list[str]:
    return [t.content for t in tok._tok.get_added_tokens_decoder().values() if t.special]


def test_special_tokens_text_in_a_document_is_ordinary_text(hf_tokenizer, tmp_path):
    """Every special token's text, alone, inside words and between spaces, encodes to ordinary
    pieces and decodes back; only the pipeline puts special ids (EOS, BOS, pad) into the stream."""
    specials = _special_texts(hf_tokenizer)
    assert {'</s>', '<pad>'} <= set(specials)
    special_ids = set(hf_tokenizer._tok.get_added_tokens_decoder())
    for text in specials + [f'x{s}y' for s in specials] + [f'before {s} after' for s in specials]:
        ids = hf_tokenizer.encode(text).tolist()
        assert not special_ids & set(ids) and hf_tokenizer.decode(ids) == text, text
    assert [ids.tolist() for ids in hf_tokenizer.encode_batch(specials)] == [
        hf_tokenizer.encode(s).tolist() for s in specials
    ]


def test_tokenize_with_a_missing_tokenizer_says_the_command_that_makes_one(small_corpus, tmp_path):
    """The line names the flag and fills in the dataset and data_dir given, and offers no training setting."""
    import subprocess
    import sys

    from tests.runs import ROOT

    cfg, _ = small_corpus
    out = subprocess.run(
        [
            sys.executable,
            '-m',
            'vrl.data',
            'tokenize',
            '--name=plays',
            f'--data_dir={cfg.data_dir}',
            f'--tokenizer={tmp_path}/none.json',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        f"error: tokenizer '{tmp_path}/none.json' (--tokenizer) does not exist. Train one with `python -m "
        f'vrl.data.tokenizer train --name=plays --data_dir={cfg.data_dir} --vocab_size=N --out={tmp_path}/none.json`.'
    )


def test_a_build_stopped_by_a_bad_line_publishes_nothing_and_resumes_from_its_finished_files(
    tmp_path, small_corpus, capsys
):
    """Files are built in order on one process: a bad line in the fourth stops the build in one line
    naming it, with no dataset to read; mended (at the same size), the build goes on from the fourth
    file, and the dataset and its ids equal a build without the stop."""
    _, tokenizer = small_corpus
    raw = tmp_path / 'raw'
    raw.mkdir()
    for f in range(6):
        (raw / f'part{f}.jsonl').write_text(
            ''.join(json.dumps({'text': f'file {f} record {i} ' * (1 + i % 5)}) + '\n' for i in range(50))
        )
    good = (raw / 'part3.jsonl').read_text()
    (raw / 'part3.jsonl').write_text(good.replace('}\n', ']\n', 1))  # line 1 is no JSON object; same size
    data_dir = str(tmp_path / 'tfds')
    with pytest.raises(
        corpus.DataError,
        match=r"part3.jsonl:1 is not valid JSON at column 28 \(expecting ',' "
        r'delimiter\): fix that line, or leave the file out.$',
    ):
        build.prepare_from_glob(str(raw), 'web', data_dir, tokenizer=tokenizer, workers=1)
    with pytest.raises(corpus.DataError, match="TFDS dataset 'web'.*vrl.data prepare"):
        corpus.open_split('web', data_dir, 'train')
    (raw / 'part3.jsonl').write_text(good)
    capsys.readouterr()
    build.prepare_from_glob(str(raw), 'web', data_dir, tokenizer=tokenizer, workers=1)
    assert 'from 6 file(s) (3 done before)' in capsys.readouterr().out
    clean = str(tmp_path / 'clean')
    build.prepare_from_glob(str(raw), 'web', clean, tokenizer=tokenizer, workers=1)
    for split in ('train', 'validation'):
        assert list(corpus.texts(corpus.open_split('web', data_dir, split))) == list(
            corpus.texts(corpus.open_split('web', clean, split))
        )
        resumed, whole = (tokens.find('web', d, split, tokenizer) for d in (data_dir, clean))
        assert [resumed[i].tolist() for i in range(len(resumed))] == [whole[i].tolist() for i in range(len(whole))]
    assert corpus.fingerprint('web', data_dir) == corpus.fingerprint('web', clean)


def _tokenizer_json(kind: str, texts: list[str], path: Path) -> HuggingFaceTokenizer:
    """A small tokenizer.json trained here: 'byte_level' (GPT-2's kind), 'nfc_byte_level' (GPT-NeoX's:
    an NFC normaliser, <|endoftext|> = 0, <|padding|> = 1) or 'metaspace' (Llama 2's: '▁' prepended,
    byte fallback)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    if kind == 'metaspace':
        rust = RustTokenizer(models.BPE(byte_fallback=True))
        rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme='first')
        rust.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme='first')])
        specials = ['<unk>', '<s>', '</s>']
        alphabet = []
    else:
        rust = RustTokenizer(models.BPE())
        if kind == 'nfc_byte_level':
            rust.normalizer = normalizers.NFC()
        rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        rust.decoder = decoders.ByteLevel()
        specials = ['<|endoftext|>', '<|padding|>']
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    rust.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet)
    )
    path.write_text(rust.to_str())
    return HuggingFaceTokenizer(path.read_bytes(), str(path))


HARD_TEXTS = [
    'cafe\u0301 vs caf\u00e9, A\u030a, \u212b and \uac00 vs \u1100\u1161',  # NFC composes or splits these
    '  leading spaces, a\ttab and\n\nnewlines ',
    '東京 🎭 naïve — “quoted”',
    'x',
    ' ',
]


@pytest.mark.parametrize('kind', ['byte_level', 'nfc_byte_level', 'metaspace'])
def test_bits_per_byte_counts_the_original_text_whatever_the_normaliser(small_corpus, tmp_path, kind):
    """The bytes each token stands for sum to the UTF-8 bytes of the document as written, on NFC,
    byte-level and Metaspace tokenizer.json files and on text quoting every special token; and an
    evaluation pass's target_bytes are exactly its documents' bytes. (With NFC, the decoded ids are
    fewer bytes than the text: counting the pieces' text would be wrong.)"""
    cfg, _ = small_corpus
    train_texts = list(itertools.islice(corpus.texts(corpus.open_split('plays', cfg.data_dir, 'train')), 400))
    tok = _tokenizer_json(kind, train_texts + HARD_TEXTS, tmp_path / 'tokenizer.json')
    specials = _special_texts(tok)
    texts = HARD_TEXTS + [f'a{s}b {s} ' for s in specials] + train_texts[:50]
    for text, (ids, n_bytes) in zip(texts, tok.encode_counting_bytes(texts)):
        assert ids.tolist() == tok.encode(text).tolist()
        assert n_bytes.sum() == len(text.encode('utf-8')) and (n_bytes >= 0).all(), (kind, text)
    if kind == 'nfc_byte_level':
        assert len(tok.decode(tok.encode(HARD_TEXTS[0])).encode('utf-8')) != len(HARD_TEXTS[0].encode('utf-8'))
    # through the pipeline: a dataset of these texts, evaluated whole
    (tmp_path / 'docs.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts * 3))
    data_dir = str(tmp_path / 'tfds')
    build.prepare_from_glob(str(tmp_path / 'docs.jsonl'), 'hard', data_dir, validation_fraction=0.5)
    eval_cfg = dataclasses.replace(cfg, name='hard', data_dir=data_dir, tokenizer=tok.path)
    batches = list(pipeline.eval_batches(eval_cfg, tok, max_batches=0))
    held_out = list(corpus.texts(corpus.open_split('hard', data_dir, 'validation')))
    assert held_out and sum(int(b['target_bytes'].sum()) for b in batches) == sum(
        len(t.encode('utf-8')) for t in held_out
    )
    assert all(not b['target_bytes'][b['loss_mask'] == 0].any() for b in batches)


@pytest.mark.parametrize('damaged', ['.tokens', '.offsets.npy'])
def test_a_truncated_shard_is_named_before_anything_reads_it(pretokenized, hf_tokenizer, tmp_path, damaged):
    """A shard's tokens (or offsets) cut to half their size, an even size that numpy would read: the
    copy is refused in one line naming the shard, its size, what its index says and the fix."""
    cfg, folder = pretokenized
    data_dir = tmp_path / 'data'
    shutil.copytree(Path(cfg.data_dir) / 'plays', data_dir / 'plays')
    copy = data_dir / Path(folder).relative_to(cfg.data_dir)
    info = json.loads((copy / tokens.MARKER).read_text())
    shard = copy / f'{info["splits"]["train"]["shards"][3]}{damaged}'
    size = shard.stat().st_size
    assert tokens.find('plays', str(data_dir), 'train', hf_tokenizer) is not None  # intact: read
    shard.write_bytes(shard.read_bytes()[: size // 2 // 2 * 2])
    with pytest.raises(corpus.DataError) as refused:
        tokens.find('plays', str(data_dir), 'train', hf_tokenizer)
    said = str(refused.value)
    assert (
        said.startswith(f'{shard} holds {size // 2 // 2 * 2:,} bytes') and 'the pre-tokenized copy is damaged' in said
    )
    assert said.endswith('--overwrite`, or tokenize on the fly: data.pretokenized=false.'), said


def test_token_ids_beyond_the_vocabulary_are_named_not_read_as_a_bad_lr(
    pretokenized, hf_tokenizer, small_corpus, tmp_path
):
    """A pre-tokenized copy whose shards are overwritten with 0xFF bytes (the sizes still right): the
    run stops at its first batch naming the id, the vocabulary and the two causes, not with a
    non-finite loss and advice to lower the LR."""
    from tests.runs import tiny_config
    from vrl.train import loop

    cfg, folder = pretokenized
    data_dir = tmp_path / 'data'
    shutil.copytree(Path(cfg.data_dir) / 'plays', data_dir / 'plays')
    copy = data_dir / Path(folder).relative_to(cfg.data_dir)
    for name in json.loads((copy / tokens.MARKER).read_text())['splits']['train']['shards']:
        shard = copy / f'{name}.tokens'
        shard.write_bytes(b'\xff' * shard.stat().st_size)
    config = tiny_config(small_corpus, steps=2, checkpoint_every=2)
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, vocab_size=hf_tokenizer.vocab_size),
        data=dataclasses.replace(config.data, data_dir=str(data_dir), tokenizer=hf_tokenizer.path),
    )
    with pytest.raises(corpus.DataError, match=r'the training data holds token id 65,535, beyond model.vocab_size='):
        loop.run(config, str(tmp_path / 'run'))
