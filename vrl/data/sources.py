"""Raw input files as documents: text, JSON lines and parquet, plain or compressed, local or on an
object store, each streamed a record (or a row batch) at a time so that memory does not grow with
a file's size. `vrl/data/build.py` makes datasets of them."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from vrl.core import storage
from vrl.core.errors import VrlError

SPLIT_MODES = ('file', 'blank_line', 'jsonl')


class DataError(VrlError, ValueError):
    """Bad or missing input data; the message names the thing and what to do."""


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
    domain_field: str = ''  # records only: a dataset per value of this (dotted) field; '' = one dataset


RECORD_FORMATS = ('.parquet', '.jsonl', '.ndjson')
COMPRESSIONS = ('.gz', '.zst')


def _format(file: str, split_mode: str) -> str:
    """'parquet', 'jsonl' or 'text', from the file's name (and split_mode for text files)."""
    name = file.lower()
    name = next((name[: -len(c)] for c in COMPRESSIONS if name.endswith(c)), name)
    if name.endswith('.parquet'):
        return 'parquet'
    return 'jsonl' if name.endswith(RECORD_FORMATS) or split_mode == 'jsonl' else 'text'


def resolve_files(input_glob: str) -> tuple[str, ...]:
    """The files a folder or glob names, local or on an object store (gs://bucket/shards/*.parquet)."""
    if storage.is_remote(input_glob):
        files = storage.matching(input_glob)
    elif Path(input_glob).is_dir():
        files = sorted(str(p) for p in Path(input_glob).rglob('*') if p.is_file())
    else:
        files = sorted(f for f in glob.glob(input_glob, recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(
            f'no input files match {input_glob!r}: give a folder or a glob of text, JSON lines '
            "(.jsonl, .jsonl.gz, .jsonl.zst) or parquet files, such as 'shards/*.parquet'."
        )
    return tuple(files)


def sizes(files: tuple[str, ...]) -> list[int]:
    """Each file's size in bytes: one listing per remote folder, not a request per object."""
    remote = {}
    for folder in sorted({f.rsplit('/', 1)[0] for f in files if storage.is_remote(f)}):
        remote.update({f'{folder}/{name}': size for name, size in storage.files(storage.path(folder)).items()})
    return [remote[f] if storage.is_remote(f) else os.path.getsize(f) for f in files]


@contextlib.contextmanager
def opened(file: str, digest=None) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(the raw file, its decompressed stream) for a local or remote file, by its ending; the raw
    bytes feed `digest` (a hashlib object) as they are read, when given."""
    with storage.path(file).open('rb') if storage.is_remote(file) else open(file, 'rb') as raw:
        if digest is not None:
            raw = _Digesting(raw, digest)
        if file.lower().endswith('.gz'):
            import gzip

            yield raw, gzip.GzipFile(fileobj=raw)
        elif file.lower().endswith('.zst'):
            yield raw, io.BufferedReader(_ZstdFrames(raw), 1 << 20)
        else:
            yield raw, raw


class _Digesting(io.RawIOBase):
    """A file read front to back, its bytes fed to `digest` on the way."""

    def __init__(self, raw: BinaryIO, digest):
        self._raw, self._digest = raw, digest

    def readable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        data = self._raw.read(len(out))
        self._digest.update(data)
        out[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._raw.tell()


def sha256(file: str) -> str:
    """The SHA-256 of a file's bytes, local or remote, read in 1 MB pieces."""
    digest = hashlib.sha256()
    with opened(file) as (raw, _):
        for chunk in iter(lambda: raw.read(1 << 20), b''):
            digest.update(chunk)
    return digest.hexdigest()


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


class InputFile:
    """One input file, read once: its non-empty documents in order (`documents`), how far the read
    has got (`position`, of `length`: rows of a parquet file, else bytes of the file as stored),
    and after them the SHA-256 of its bytes (`sha256`: from the same read, except a parquet file's,
    whose reader seeks)."""

    def __init__(self, file: str, spec: CorpusSpec, skipped: SkipCounter):
        self.file, self._spec, self._skipped = file, spec, skipped
        self.parquet = _format(file, spec.split_mode) == 'parquet'
        self.compressed = file.lower().endswith(COMPRESSIONS)
        self._digest = hashlib.sha256()
        self._raw: BinaryIO | None = None
        self._rows = 0
        self._read_whole = False

    def length(self, size: int) -> int:
        """The file's rows (parquet: from its footer, one small read) or its `size` in bytes."""
        if not self.parquet:
            return size
        import pyarrow.parquet as pq

        with opened(self.file) as (raw, _):
            return pq.ParquetFile(raw).metadata.num_rows

    def position(self) -> int:
        return self._rows if self.parquet else self._raw.tell()

    def documents(self) -> Iterator[tuple[str, str]]:
        """(text, domain) of each non-empty document; the domain is its record's `spec.domain_field`,
        '' without one."""
        with opened(self.file, None if self.parquet else self._digest) as (raw, stream):
            self._raw = raw
            for self._rows, (doc, domain) in enumerate(_file_documents(self.file, stream, self._spec)):
                if doc.strip():
                    yield doc, domain
                elif (kind := _format(self.file, self._spec.split_mode)) != 'text':  # a text file's are its blank lines
                    self._skipped.skip(f'empty documents ({kind} file)')
            while raw.read(1 << 20):  # the digest covers the bytes after the last document too
                pass
            self._read_whole = True

    def sha256(self) -> str:
        """Of the whole file: read again if the parquet reader read it, or its documents were not read to the end."""
        return self._digest.hexdigest() if self._read_whole and not self.parquet else sha256(self.file)


def _file_documents(file: str, stream: BinaryIO, spec: CorpusSpec) -> Iterator[tuple[str, str]]:
    """(text, domain) of each document of one file, as its format has them."""
    if _format(file, spec.split_mode) != 'text':
        fields = (spec.text_field, spec.domain_field) if spec.domain_field else (spec.text_field,)
        for where, record in records(file, stream, spec.split_mode, fields):
            domain = str(field(record, spec.domain_field, where, '--domain_field')) if spec.domain_field else ''
            yield text_of(field(record, spec.text_field, where, '--text_field')), domain
    elif spec.split_mode == 'blank_line':
        blocks = _blank_line_blocks(io.TextIOWrapper(stream, encoding='utf-8', newline=''))
        yield from ((block, '') for block in _guarded(file, 'text', blocks))
    else:
        yield from ((text, '') for text in _guarded(file, 'text', _whole_text(stream)))


def _whole_text(stream: BinaryIO) -> Iterator[str]:
    yield io.TextIOWrapper(stream, encoding='utf-8', newline='').read()


def records(file: str, stream: BinaryIO, split_mode: str, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a JSON lines or parquet file (of a parquet file, the
    columns `fields` start with)."""
    if _format(file, split_mode) == 'parquet':
        yield from _guarded(file, 'parquet', _parquet_records(file, stream, fields))
    else:
        yield from _guarded(
            file, 'JSON lines', _jsonl_records(file, io.TextIOWrapper(stream, encoding='utf-8', newline=''))
        )


def _guarded(file: str, kind: str, items: Iterator):
    """`items`, with a corrupt compressed stream, text that is not UTF-8 or an unreadable parquet
    file raised as one DataError naming `file`."""
    try:
        for item in items:
            yield item
    except UnicodeDecodeError as e:
        raise DataError(
            f'{file} is not UTF-8 ({e.reason}); convert it, e.g. `iconv -f latin1 -t utf-8`, or remove '
            'it from the input.'
        ) from None
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - zstandard, gzip and pyarrow each raise their own kinds
        raise DataError(
            f'{file} cannot be read as {kind}: {" ".join(str(e).split())[:200]}. Is it complete? Fetch '
            'it again, or remove it from the input.'
        ) from None


def text_of(value) -> str:
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
    columns = list(dict.fromkeys(dotted.split('.', 1)[0] for dotted in fields))
    for column, dotted in zip(columns, fields):
        if column not in parquet.schema_arrow.names:
            flag = '--text_field' if dotted == fields[0] else '--domain_field'
            raise DataError(
                f'{file} has no column {column!r} (columns: {parquet.schema_arrow.names}); pass the right '
                f'one with {flag}=NAME.'
            )
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
                raise DataError(
                    f'{file}:{line_no} is not valid JSON at column {e.colno} '
                    f'({e.msg.removesuffix(" at").lower()}): fix that line, or leave the file out.'
                ) from e
            if not isinstance(record, dict):
                raise DataError(f'{file}:{line_no} is a JSON {type(record).__name__}, not an object.')
            yield f'{file}:{line_no}', record


def field(record: dict, dotted: str, where: str, flag: str):
    """record['a']['b'] for 'a.b'; DataError names the place and the keys there."""
    value = record
    for key in dotted.split('.'):
        if not isinstance(value, dict) or key not in value:
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise DataError(
                f'{where} has no field {dotted!r} ({key!r} missing; there: {keys}); pass the right '
                f'one with {flag}=NAME.'
            )
        value = value[key]
    return value
