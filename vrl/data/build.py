"""Building a dataset from raw input files, on every core of every host, resumable.

    python -m vrl.data prepare --input=GLOB --name=NAME --data_dir=DIR [--tokenizer=PATH] [--workers=N]

Each input file is a unit of work, written whole by whichever process takes it: a pool of
processes on each host (`workers`), and on a jax.distributed job each host every process_count-th
file. A unit streams its file once (vrl/data/sources.py) and writes its documents, in input order,
as its own shard of each split, and with a tokenizer their ids too, in the same pass:

    DATA_DIR/NAME/1.0.0/
        NAME-train.array_record-00003-of-00042       unit 3's training documents (TFDS's naming and
        NAME-validation.array_record-00003-of-00042  encoding: tfds.data_source reads them; a unit
                                                     without documents of a split writes no shard of it)
        vrl_tokens/<tokenizer fingerprint>/...       their ids, with a tokenizer (vrl/data/shards.py)
        dataset_info.json, features.json             TFDS's metadata, once every unit is done
        vrl_inputs.json                              then: the dataset is complete
    DATA_DIR/NAME/vrl_build/                         the build's own state, removed when it is done:
        plan.json                                    what is being built: the settings, files and sizes
        units/00003.json                             what unit 3 held, once its shards are in place

With a domain field (SlimPajama's meta.redpajama_set_name) a unit writes each record to the dataset
of its domain, NAME_<domain>, and `NAME/vrl_domains.json`, last, lists them. A killed build resumes
from the units it finished (the same plan is kept; another one is started afresh). The result does not depend on how
many processes or hosts wrote it. Validation is held
out by document, each with chance `validation_fraction` by a hash of its text (no pass over the
corpus first, nothing held per document; identical documents fall in the same split), or by whole
files (an exact share of the files, from their names). Memory does not grow with the number of documents or a file's
size.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from typing import Iterable, TypeVar

import jax
import numpy as np
import tensorflow_datasets as tfds
from array_record.python import array_record_module
from etils import epath
from tensorflow_datasets.core import dataset_info, naming
from tensorflow_datasets.core import splits as tfds_splits

from vrl.core import multihost, storage
from vrl.data import shards, sources
from vrl.data.layout import (
    BUILD,
    DOMAINS,
    INPUTS,
    PLAN,
    TEMPLATE,
    UNITS,
    VERSION,
    checked_data_dir,
    default_data_dir,
    fingerprint_of,
)
from vrl.data.pool import in_pool
from vrl.data.shards import Encoder
from vrl.data.sources import CorpusSpec, DataError, SkipCounter

tfds.disable_progress_bar()

FEATURES = tfds.features.FeaturesDict({'text': tfds.features.Text()})
PARALLEL_BYTES = 64 << 20  # inputs smaller than this are built in one process unless `workers` says otherwise
# A file's documents go to one shard per this much of it: array_record's writer holds 64 bytes a record
# until it closes, so a shard's size bounds a build's memory (a 10M-document file is several shards).
SHARD_BYTES = 64 << 20  # of a plain file
SHARD_COMPRESSED_BYTES = 16 << 20  # of a .zst or .gz file (text compresses about 4x)
SHARD_ROWS = 1 << 20  # of a parquet file
_NAME = re.compile(r'^[a-z][a-z0-9_]*$')
T = TypeVar('T')


def _hash(unit: str) -> int:
    """The first 64 bits of the SHA-256 of `unit` (a document's text, a file's path), as an int64."""
    return int.from_bytes(hashlib.sha256(unit.encode()).digest()[:8], 'big') - (1 << 63)


def _held_out_at_most(fraction: float) -> int:
    """The int64 that a unit's `_hash` is at most with chance `fraction`."""
    return int(fraction * 2**64) - 2**63 - 1


def _validation_cut(hashes: np.ndarray, fraction: float) -> int | None:
    """The largest of the round(fraction * n) smallest of n distinct unit hashes (at least one, and
    not all, when fraction > 0 and n >= 2), so that exactly that many are held out; None for none."""
    n_val = round(fraction * len(hashes))
    if fraction > 0 and len(hashes) >= 2:
        n_val = min(max(n_val, 1), len(hashes) - 1)
    return int(np.partition(hashes, n_val - 1)[n_val - 1]) if n_val else None


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One input file and where its documents go."""

    index: int
    file: str
    file_id: str  # its path relative to the inputs' common folder: whole files held out do not depend on where they lie
    held_out: bool | None  # the whole file's split (holdout_unit='file'); None: each document's by its hash
    first_shard: int  # its documents go to shards first_shard.. of each split, one per _per_shard of the file
    shards: int
    limit: int | None = None  # documents still wanted (--limit); None: all


def _per_shard(source: sources.InputFile) -> int:
    """How much of a file (in InputFile.position's measure) one shard holds."""
    return SHARD_ROWS if source.parquet else SHARD_COMPRESSED_BYTES if source.compressed else SHARD_BYTES


def _units(spec: CorpusSpec, sizes: list[int]) -> list[_Unit]:
    """The plan: each file's unit, with its place among the shards (from its size, or a parquet
    file's rows: a small read each, in parallel)."""
    inputs = [sources.InputFile(f, spec, SkipCounter()) for f in spec.files]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        lengths = list(pool.map(lambda pair: pair[0].length(pair[1]), zip(inputs, sizes)))
    counts = [max(1, -(-length // _per_shard(source))) for source, length in zip(inputs, lengths)]
    firsts = np.cumsum([0] + counts[:-1]).tolist()
    bare = [f.split('://', 1)[-1] for f in spec.files]
    root = os.path.dirname(bare[0]) if len(bare) == 1 else os.path.commonpath(bare)
    ids = [os.path.relpath(f, root) for f in bare]
    held: list[bool | None] = [None] * len(ids)
    if spec.holdout_unit == 'file':
        hashes = np.array([_hash(file_id) for file_id in ids], np.int64)
        cut = _validation_cut(hashes, spec.validation_fraction)
        if cut is None and spec.validation_fraction > 0:
            raise DataError(
                f'{len(ids)} file(s) are too few to hold out a validation split by file at '
                f'validation_fraction={spec.validation_fraction}: give more input (at least 2 files), '
                'or --validation_fraction=0 and evaluate on another dataset.'
            )
        held = [cut is not None and bool(h <= cut) for h in hashes]
    return [
        _Unit(i, f, file_id, h, first, n)
        for i, (f, file_id, h, first, n) in enumerate(zip(spec.files, ids, held, firsts, counts))
    ]


def _shard_count(units: list[_Unit]) -> int:
    """The shards of each split, all files' together (the N of -of-N)."""
    return units[-1].first_shard + units[-1].shards


def _splits(spec: CorpusSpec) -> tuple[str, ...]:
    return ('train', 'validation') if spec.validation_fraction > 0 else ('train',)


class _SplitWriter:
    """One shard of one split of one dataset: its documents TFDS-encoded into an array_record file,
    and with a tokenizer their ids (shards.ShardWriter); `close()` moves them into place and says
    what they hold. Made on the shard's first document of that dataset and split: no empty shards."""

    def __init__(self, target: epath.Path, dataset: str, split: str, shard: int, count: int, tokenizer: Encoder | None):
        self._final = str(_template(target, dataset, split).sharded_filepath(shard_index=shard, num_shards=count))
        self._scratch = tempfile.TemporaryDirectory() if storage.is_remote(target) else None
        self._local = (os.path.join(self._scratch.name, 'shard') if self._scratch else self._final) + '.partial'
        os.makedirs(os.path.dirname(self._local), exist_ok=True)
        self._records = array_record_module.ArrayRecordWriter(self._local, 'group_size:1')
        self._ids = (
            shards.ShardWriter(
                str(shards.folder(target, tokenizer) / f'{split}-{shard:05d}-of-{count:05d}'),
                shards.dtype_for(tokenizer.vocab_size),
            )
            if tokenizer
            else None
        )
        self._tokenizer, self._pending = tokenizer, []
        self.documents = self.bytes = 0

    def write(self, text: str) -> None:
        record = serialize(text)
        self._records.write(record)
        self.documents += 1
        self.bytes += len(record)
        if self._tokenizer:
            self._pending.append(text)
            if len(self._pending) == shards.ENCODE_CHUNK:
                self._encode()

    def _encode(self) -> None:
        for ids in self._tokenizer.encode_batch(self._pending):
            self._ids.write(ids)
        self._pending = []

    def close(self) -> dict:
        if self._ids is not None:
            self._encode()
            self._ids.close()
        self._records.close()
        storage.put_file(self._local, storage.path(self._final))
        if self._scratch:
            self._scratch.cleanup()
        return {'documents': self.documents, 'bytes': self.bytes, 'tokens': self._ids.tokens if self._ids else 0}


def serialize(text: str) -> bytes:
    """`FEATURES.serialize_example({'text': text})`, the tf.train.Example protobuf TFDS stores,
    encoded directly: TFDS's general serializer took 60 us a document, most of a build's time."""
    value = text.encode('utf-8')
    bytes_list = b'\x0a' + _varint(len(value)) + value  # BytesList.value (field 1)
    feature = b'\x0a' + _varint(len(bytes_list)) + bytes_list  # Feature.bytes_list (field 1)
    entry = b'\x0a\x04text\x12' + _varint(len(feature)) + feature  # map entry: key (1), value (2)
    features = b'\x0a' + _varint(len(entry)) + entry  # Features.feature (field 1)
    return b'\x0a' + _varint(len(features)) + features  # Example.features (field 1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _template(target: epath.Path, dataset: str, split: str) -> naming.ShardedFileTemplate:
    return naming.ShardedFileTemplate(
        data_dir=target, template=TEMPLATE, dataset_name=dataset, split=split, filetype_suffix='array_record'
    )


def dataset_name(name: str, domain: str) -> str:
    """The dataset that a build named `name` makes of a domain's documents: NAME_<domain in
    lower_snake_case>, or NAME itself without domains."""
    return f'{name}_{re.sub(r"[^a-z0-9]+", "_", domain.lower()).strip("_")}' if domain else name


def _write_unit(task: tuple) -> dict:
    """One input file as its shards of each split of each dataset it has documents for; returns what
    they held, also written to its record in the build's units/ folder (last: the unit is done)."""
    unit, spec, name, data_dir, count, tokenizer = task
    skipped = SkipCounter()
    source = sources.InputFile(unit.file, spec, skipped)
    at_most = _held_out_at_most(spec.validation_fraction)
    writers: dict[tuple[str, str], _SplitWriter] = {}
    datasets: dict[str, dict] = {}
    shard, kept, per_shard = unit.first_shard, 0, _per_shard(source)

    def close_shard() -> None:
        for (domain, split), writer in writers.items():
            entry = datasets.setdefault(dataset_name(name, domain), {'domain': domain, 'shards': {}})
            entry['shards'].setdefault(split, {})[str(shard)] = writer.close()
        writers.clear()

    for text, domain in source.documents():
        if kept == unit.limit:
            break
        here = unit.first_shard + min(source.position() // per_shard, unit.shards - 1)
        if here != shard:
            close_shard()
            shard = here
        held_out = unit.held_out if unit.held_out is not None else _hash(text) <= at_most  # copies go together
        key = (domain, 'validation' if held_out else 'train')
        if key not in writers:
            dataset = dataset_name(name, domain)
            writers[key] = _SplitWriter(_version(data_dir, dataset), dataset, key[1], shard, count, tokenizer)
        writers[key].write(text)
        kept += 1
    close_shard()
    record = {'file': unit.file_id, 'sha256': source.sha256(), 'skipped': skipped.counts, 'datasets': datasets}
    storage.write_bytes(_build_dir(data_dir, name) / UNITS / f'{unit.index:05d}.json', json.dumps(record).encode())
    return record


def _version(data_dir: str, dataset: str) -> epath.Path:
    return storage.path(data_dir) / dataset / VERSION


def _build_dir(data_dir: str, name: str) -> epath.Path:
    """Where a build keeps its plan and its units' records until it is done (beside the versions of
    dataset `name`, which it does not list: not a version's name)."""
    return storage.path(data_dir) / name / BUILD


def _plan(spec: CorpusSpec, sizes: list[int], units: list[_Unit], tokenizer: Encoder | None) -> dict:
    settings = dataclasses.asdict(spec)
    settings['files'] = [[f.split('://', 1)[-1], size, u.shards] for f, size, u in zip(spec.files, sizes, units)]
    return {**settings, 'tokenizer': tokenizer.fingerprint if tokenizer else None}


def _begin(spec: CorpusSpec, name: str, data_dir: str, plan: dict, overwrite: bool) -> None:
    """On process 0, before any unit: keeps a build complete from the same inputs (DataError for
    other inputs, unless `overwrite`: then its datasets are removed, with their pre-tokenized
    copies); otherwise resumes an unfinished build of the same plan, or clears another's and writes
    the plan."""
    build_dir = _build_dir(data_dir, name)
    done = _complete(spec, name, data_dir)
    if done is not None:
        difference = _difference(done['inputs'], _inputs_record(spec))
        if not difference:
            return
        if not overwrite:
            raise DataError(
                f'dataset {name!r} in {data_dir} was prepared from other inputs ({difference}); '
                'pass --overwrite to rebuild it, or choose another --name.'
            )
        logging.warning('rebuilding %s: %s', name, difference)
        _remove(data_dir, name, done['datasets'].values())
    elif (build_dir / PLAN).exists() and json.loads((build_dir / PLAN).read_text()) == plan:
        logging.info('resuming the build of %s in %s', name, build_dir)
        return
    elif build_dir.exists() or (not spec.domain_field and _version(data_dir, name).exists()):
        logging.warning('clearing an unfinished build of %s in %s: it was of other inputs or settings', name, data_dir)
        touched = {dataset for unit in _records(build_dir) for dataset in unit['datasets']}
        _remove(data_dir, name, touched | ({name} if not spec.domain_field else set()))
    (build_dir / UNITS).mkdir(parents=True, exist_ok=True)
    storage.write_bytes(build_dir / PLAN, json.dumps(plan).encode())


def _complete(spec: CorpusSpec, name: str, data_dir: str) -> dict | None:
    """{'inputs': what it was built from, 'datasets': {domain: dataset}} of a finished build, else None."""
    if spec.domain_field:
        marker = storage.path(data_dir) / name / DOMAINS
        return json.loads(marker.read_text()) if marker.exists() else None
    marker = _version(data_dir, name) / INPUTS
    return {'inputs': json.loads(marker.read_text()), 'datasets': {'': name}} if marker.exists() else None


def _remove(data_dir: str, name: str, datasets: Iterable[str]) -> None:
    """Datasets of a build (with their pre-tokenized copies) and the build's own files."""
    for dataset in datasets:
        if _version(data_dir, dataset).exists():
            _version(data_dir, dataset).rmtree()
    for leftover in (_build_dir(data_dir, name), storage.path(data_dir) / name / DOMAINS):
        if leftover.exists():
            leftover.rmtree() if leftover.is_dir() else storage.delete(leftover)


def _records(build_dir: epath.Path) -> list[dict]:
    """The records of the units done, in order: a small read each (in parallel, many on a store)."""
    if not (build_dir / UNITS).exists():
        return []
    names = sorted(storage.files(build_dir / UNITS))
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda f: json.loads((build_dir / UNITS / f).read_text()), names))


def _inputs_record(spec: CorpusSpec, digests: list[str] | None = None) -> dict:
    """What a dataset was prepared from: its files' contents (wherever they lie) and the split settings."""
    settings = dataclasses.asdict(spec)
    del settings['files']
    return {'file_sha256': sorted(digests or [sources.sha256(f) for f in spec.files]), **settings}


def _difference(saved: dict, current: dict) -> str:
    saved = {'text_field': saved.get('jsonl_field', 'text'), 'limit': 0, 'domain_field': '', **saved}  # defaults then
    saved.pop('jsonl_field', None)
    if saved['file_sha256'] != current['file_sha256']:
        n_then, n_now = len(saved['file_sha256']), len(current['file_sha256'])
        return f'{n_then} input file(s) then, {n_now} now' if n_then != n_now else "the input files' contents differ"
    return ', '.join(f'{k} was {saved.get(k)!r}, now {v!r}' for k, v in current.items() if saved.get(k) != v)


def _documents(record: dict) -> int:
    """The documents a unit's record holds, in all its datasets, splits and shards."""
    return sum(
        e['documents'] for d in record['datasets'].values() for split in d['shards'].values() for e in split.values()
    )


def _finish(spec: CorpusSpec, name: str, data_dir: str, count: int, tokenizer: Encoder | None) -> list[str]:
    """On process 0, once every unit is done: each dataset's metadata, its vrl_inputs.json (it is
    complete), its pre-tokenized copy's tokens.json; with domains, NAME/vrl_domains.json last (the
    build is complete); then the build's own files go. Returns the lines that say what was prepared."""
    records = _records(_build_dir(data_dir, name))
    found: dict[str, str] = {}
    for record in records:
        for dataset, entry in record['datasets'].items():
            clash = found.setdefault(dataset, entry['domain'])
            if clash != entry['domain'] or dataset == f'{name}_':
                raise DataError(
                    f'domains {sorted({clash, entry["domain"]})} of {spec.domain_field!r} make the same '
                    f'dataset name {dataset!r}; rename them in the input.'
                )
    if not found:
        raise DataError(
            f'no non-empty documents in {len(spec.files)} input file(s): '
            f'{", ".join(spec.files[:3])}{" ..." if len(spec.files) > 3 else ""}.'
        )
    inputs = _inputs_record(spec, [r['sha256'] for r in records])
    said = []
    for dataset, domain in sorted(found.items()):
        per_shard: dict[str, dict[int, dict]] = {split: {} for split in _splits(spec)}  # what each shard holds
        for r in records:
            for split, entries in r['datasets'].get(dataset, {'shards': {}})['shards'].items():
                per_shard[split].update({int(k): entry for k, entry in entries.items()})
        totals = {split: sum(e['documents'] for e in held.values()) for split, held in per_shard.items()}
        if spec.validation_fraction > 0 and not all(totals.values()):
            n = sum(totals.values())
            raise DataError(
                f'{n:,} document(s){f" of domain {domain!r}" if domain else ""} are too few to hold out a '
                f'validation split at validation_fraction={spec.validation_fraction} (each is held out '
                f'with that chance; here {"none was" if not totals["validation"] else "all were"}): give '
                'more input, a larger fraction, or --validation_fraction=0 and evaluate on another dataset.'
            )
        target = _version(data_dir, dataset)
        _write_info(target, dataset, per_shard, count)
        record = json.dumps({**inputs, 'domain': domain} if domain else inputs).encode()
        storage.write_bytes(target / INPUTS, record)
        if tokenizer:
            splits = {
                split: {
                    'shards': [f'{split}-{k:05d}-of-{count:05d}' for k in sorted(held)],
                    'documents': totals[split],
                    'shard_documents': [held[k]['documents'] for k in sorted(held)],
                    'tokens': sum(e['tokens'] for e in held.values()),
                }
                for split, held in per_shard.items()
            }
            shards.write_marker(
                shards.folder(target, tokenizer),
                dataset,
                tokenizer,
                splits,
                {'dataset_fingerprint': fingerprint_of(record), 'text_field': 'text'},
            )
        said.append(
            f'prepared dataset {dataset}: '
            + ', '.join(f'{n:,} {split}' for split, n in totals.items())
            + ' documents'
            + (f' ({spec.domain_field} = {domain!r})' if domain else '')
        )
    if spec.domain_field:
        storage.write_bytes(
            storage.path(data_dir) / name / DOMAINS,
            json.dumps({'inputs': inputs, 'datasets': dict(sorted((d, n) for n, d in found.items()))}).encode(),
        )
    _build_dir(data_dir, name).rmtree()
    skipped = SkipCounter()
    for r in records:
        for reason, n in r['skipped'].items():
            skipped.counts[reason] = skipped.counts.get(reason, 0) + n
    if skipped.counts:
        said[-1] += f' ({skipped.summary()})'
    return said


def _write_info(target: epath.Path, name: str, per_shard: dict[str, dict[int, dict]], count: int) -> None:
    """TFDS's dataset_info.json and features.json, from what each of the `count` shards of each split
    holds (one that got no documents was not written: a length of 0, which TFDS skips)."""
    identity = dataset_info.DatasetIdentity(
        name=name, version=tfds.core.Version(VERSION), data_dir=str(target), module_name=''
    )
    info = dataset_info.DatasetInfo(
        builder=identity, features=FEATURES, description='A text corpus prepared by vrl (vrl/data/build.py).'
    )
    info.set_file_format('array_record')
    info.set_splits(
        tfds_splits.SplitDict(
            [
                tfds_splits.SplitInfo(
                    name=split,
                    shard_lengths=[held.get(k, {}).get('documents', 0) for k in range(count)],
                    num_bytes=sum(e['bytes'] for e in held.values()),
                    filename_template=_template(target, name, split),
                )
                for split, held in per_shard.items()
            ]
        )
    )
    with tempfile.TemporaryDirectory() as local:
        info.write_to_directory(local)
        for file in sorted(os.listdir(local), key=lambda f: f == 'dataset_info.json'):  # dataset_info.json last
            storage.put_file(os.path.join(local, file), target / file)


def prepare(
    spec: CorpusSpec,
    name: str,
    data_dir: str,
    overwrite: bool = False,
    tokenizer: Encoder | None = None,
    workers: int | None = None,
) -> str:
    """Builds dataset `name` in `data_dir` (local or on an object store) from `spec`'s files, with
    `tokenizer`'s pre-tokenized copy when given; returns its folder. See `_build`."""
    _build(spec, name, data_dir, overwrite, tokenizer, workers)
    return str(_version(data_dir or default_data_dir(), name))


def _build(
    spec: CorpusSpec, name: str, data_dir: str, overwrite: bool, tokenizer: Encoder | None, workers: int | None
) -> dict[str, str]:
    """Builds the datasets of `spec`'s files: `name`, or with `spec.domain_field` one per domain;
    returns {domain ('' without domains): dataset}. Run on every host of a jax.distributed job, each
    builds its share of the files. `workers`: processes on this host (default: every core, or one for
    inputs under PARALLEL_BYTES).

    A build already done is kept if it was made from the same inputs; from other inputs, DataError
    names the difference unless `overwrite` (then it is rebuilt, and its pre-tokenized copies
    removed)."""
    if not _NAME.match(name):
        raise DataError(f'dataset name {name!r} is invalid: use lower_snake_case (letters, digits, _).')
    if not 0 <= spec.validation_fraction < 1:
        raise DataError(f'validation_fraction={spec.validation_fraction} is invalid: allowed [0, 1).')
    if spec.split_mode not in sources.SPLIT_MODES:
        raise DataError(f'split_mode={spec.split_mode!r} is invalid: allowed one of {sources.SPLIT_MODES}.')
    if spec.limit < 0:
        raise DataError(f'limit={spec.limit} is invalid: allowed a number of documents >= 1, or 0 for all.')
    data_dir = checked_data_dir(data_dir)
    sizes = sources.sizes(spec.files)
    units = _units(spec, sizes)
    multihost.on_process_0(lambda: _begin(spec, name, data_dir, _plan(spec, sizes, units, tokenizer), overwrite))
    done = _complete(spec, name, data_dir)  # after _begin: only a build from the same inputs
    if done is not None:
        return done['datasets']
    if spec.validation_fraction == 0:
        logging.warning('no validation split (validation_fraction=0)')
    build_dir = _build_dir(data_dir, name)
    finished = (
        {int(f.split('.')[0]) for f in storage.files(build_dir / UNITS)} if (build_dir / UNITS).exists() else set()
    )
    if jax.process_index() == 0:
        print(
            f'preparing dataset {name} in {build_dir.parent / VERSION if not spec.domain_field else build_dir.parent}'
            f' from {len(units):,} file(s)' + (f' ({len(finished):,} done before)' if finished else ''),
            flush=True,
        )
    start = time.perf_counter()
    multihost.everywhere(lambda: _write_units(spec, name, data_dir, units, sizes, finished, tokenizer, workers))
    said = multihost.on_process_0(lambda: _finish(spec, name, data_dir, _shard_count(units), tokenizer))
    if said:
        said[-1] += f' in {time.perf_counter() - start:.1f}s'
        print('\n'.join(said), flush=True)
    return _complete(spec, name, data_dir)['datasets']


def _write_units(
    spec: CorpusSpec,
    name: str,
    data_dir: str,
    units: list[_Unit],
    sizes: list[int],
    finished: set[int],
    tokenizer: Encoder | None,
    workers: int | None,
) -> None:
    """This process's units not done before: every process_count-th; with --limit, all of them on
    process 0, in order (each takes what the earlier ones left of the limit)."""
    count = _shard_count(units)
    if spec.limit:
        if jax.process_index() != 0:
            return
        left = spec.limit - sum(_documents(record) for record in _records(_build_dir(data_dir, name)))
        for unit in units:
            if unit.index not in finished:
                left -= _documents(
                    _write_unit((dataclasses.replace(unit, limit=left), spec, name, data_dir, count, tokenizer))
                )
        return
    mine = [u for u in units if u.index % jax.process_count() == jax.process_index() and u.index not in finished]
    if workers is None:
        workers = (os.cpu_count() or 1) if sum(sizes[u.index] for u in mine) >= PARALLEL_BYTES else 1
    tasks = [(unit, spec, name, data_dir, count, tokenizer) for unit in mine]
    for _ in in_pool(_write_unit, tasks, workers, 'preparing', [sizes[u.index] for u in mine]):
        pass


def prepare_from_glob(
    input_glob: str,
    name: str,
    data_dir: str,
    overwrite: bool = False,
    tokenizer: Encoder | None = None,
    workers: int | None = None,
    **spec_fields,
) -> str:
    return prepare(
        CorpusSpec(files=sources.resolve_files(input_glob), **spec_fields),
        name,
        data_dir,
        overwrite,
        tokenizer,
        workers,
    )


def prepare_domains(
    input_glob: str,
    name: str,
    data_dir: str,
    domain_field: str,
    overwrite: bool = False,
    tokenizer: Encoder | None = None,
    workers: int | None = None,
    **spec_fields,
) -> dict[str, str]:
    """One dataset per value of `domain_field` in the records of JSON lines or parquet files (e.g.
    SlimPajama's meta.redpajama_set_name), named NAME_<value in lower_snake_case>, each with its own
    validation split, built in one pass over the files like `prepare`'s one dataset; returns
    {domain: dataset name}. Train on them with data.mixture."""
    spec = CorpusSpec(
        files=sources.resolve_files(input_glob), split_mode='jsonl', domain_field=domain_field, **spec_fields
    )
    return _build(spec, name, data_dir, overwrite, tokenizer, workers)
