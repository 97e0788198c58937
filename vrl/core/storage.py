"""Paths that may be remote: one place that knows whether a path is an object-store URL.

Every path a user gives (a workdir, a data_dir, a tokenizer) goes through `path()`: a local path
becomes an absolute `epath.Path`, a URL (`gs://bucket/run`, `s3://...`) stays a URL and is served by
fsspec (gcsfs for gs://; etils.epath picks it). The rest of vrl reads and writes through the
`epath.Path` it gets and does not care which it is; what an object store cannot do (append to a
file, lock one, rename a folder cheaply) is asked of this module:

- `is_remote(p)`: whether p lives on an object store;
- `create_exclusive(p, data)`: write p only if no object or file is there (GCS: a
  generation-match precondition; a local file: O_EXCL), False if one was;
- `read_versioned(p)` and `write_if(p, data, generation)`: a GCS object read with its generation,
  and replaced only if that generation is still the live one (the workdir's lease);
- `append(p, data, new)`: a file that grows costs what it grew (GCS: the new bytes composed onto
  the object server-side);
- every request to an object store gives up after `request_timeout_s()` without an answer,
  retried by the client with backoff (6 tries: gcsfs's own, and `tensorstore_retries()` for
  TensorStore);
- `exists(p, what)` and `check_writable(p, what)`: one clear line (StorageError) for a bucket that
  does not exist, no credentials, permission denied or an unreachable endpoint, before anything
  else is read or written;
- `scratch(p)`: a local folder standing for remote p, for what must be written locally first
  (TensorBoard's event files, which are appended to);
- `read_range(url, start, end)`: a byte range of a file or object, read in place.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
import uuid
from typing import Callable, TypeVar

import tqdm
from etils import epath

from vrl.core.errors import VrlError

T = TypeVar('T')
REMOTE_SCHEMES = ('gs://', 's3://', 'gcs://', 'az://', 'abfs://')
COPY_CHUNK = 8 << 20  # bytes a copy holds in memory at once
# seconds a request to an object store may wait for a connection or for the next bytes of its
# answer before it is abandoned (and retried), unless VRL_STORE_TIMEOUT_S says otherwise; a request
# may take 5x as long in all
REQUEST_TIMEOUT_S = 60.0


class StorageError(VrlError, OSError):
    """A path that cannot be used: the message names it and says what to do."""


def is_remote(p: str | os.PathLike) -> bool:
    return str(p).startswith(REMOTE_SCHEMES)


def path(p: str | os.PathLike) -> epath.Path:
    """`p` as an epath.Path: a URL as it is, a local path made absolute."""
    if is_remote(p):
        _configure_clients()
        return epath.Path(str(p))
    return epath.Path(os.path.abspath(os.path.expanduser(str(p))))


def _filesystem(p: epath.Path):
    """The fsspec filesystem and the path within it for a remote `p`."""
    import fsspec

    fs, inner = fsspec.core.url_to_fs(str(p))
    return fs, inner


def create_exclusive(p: epath.Path, data: bytes) -> bool:
    """Writes `data` to `p` only if nothing is there yet; False if something was."""
    if not is_remote(p):
        try:
            fd = os.open(os.fspath(p), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
        return True
    fs, inner = _filesystem(p)
    try:
        fs.pipe_file(inner, data, mode='create')  # GCS: ifGenerationMatch=0
    except FileExistsError:
        return False
    return True


def read_versioned(p: epath.Path) -> tuple[bytes, int] | None:
    """GCS object `p` and its generation (which every write of it changes), or None if absent."""
    fs, bucket, key = _gcs_object(p)
    try:
        headers, data = fs.call('GET', 'b/{}/o/{}', bucket, key, alt='media')
    except FileNotFoundError:
        return None
    return data, int(headers['X-Goog-Generation'])


def write_if(p: epath.Path, data: bytes, generation: int) -> int | None:
    """Writes GCS object `p` only if its live generation is `generation` (0: only if there is none);
    returns the new generation, or None if the object had changed."""
    fs, bucket, key = _gcs_object(p)
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({"name": key})}\r\n'
            f'--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        + data
        + f'\r\n--{boundary}--'.encode()
    )
    try:
        written = fs.call(
            'POST',
            f'{fs._location}/upload/storage/v1/b/{bucket}/o',
            uploadType='multipart',
            ifGenerationMatch=str(generation),
            data=body,
            json_out=True,
            headers={'Content-Type': f'multipart/related; boundary="{boundary}"'},
        )
    except FileExistsError:  # gcsfs's reading of 412 Precondition Failed
        return None
    return int(written['generation'])


def append(p: epath.Path, data: bytes, new: bool) -> None:
    """Appends `data` to file or object `p` (`new`: p is not there yet, and is created with it). On
    GCS only `data` goes up, as an object beside p composed onto it server-side; another store has
    p rewritten whole."""
    if not is_remote(p):
        with open(p, 'ab') as f:
            f.write(data)
    elif new:
        p.write_bytes(data)
    elif not str(p).startswith(('gs://', 'gcs://')):
        p.write_bytes(p.read_bytes() + data)
    else:
        fs, bucket, key = _gcs_object(p)
        # a hidden name, which no reader of p's folder (TensorBoard) takes for one of its files
        part = posixpath.join(posixpath.dirname(key), f'.{uuid.uuid4().hex[:8]}.part')
        fs.pipe_file(f'{bucket}/{part}', data)
        try:  # (a compose retried after it landed would append twice: readers keep a step's last record)
            fs.call(
                'POST',
                'b/{}/o/{}/compose',
                bucket,
                key,
                json_out=True,
                json={
                    'sourceObjects': [{'name': key}, {'name': part}],
                    'destination': {'contentType': 'application/octet-stream'},
                },
            )
        finally:
            fs.rm_file(f'{bucket}/{part}')


def _gcs_object(p: epath.Path):
    """(gcsfs client, bucket, object name) of gs:// path `p`; StorageError for any other store."""
    if not str(p).startswith(('gs://', 'gcs://')):
        raise StorageError(f'{p}: a lease needs GCS object generations (gs://); use a gs:// or local path')
    fs, inner = _filesystem(p)
    bucket, key, _ = fs.split_path(inner)
    return fs, bucket, key


def write_bytes(p: epath.Path, data: bytes) -> None:
    """Replaces `p` whole: an object store has no partial object; a local file is written beside and
    renamed, so a reader never sees half of it."""
    if is_remote(p):
        p.write_bytes(data)
        return
    partial = p.parent / f'.{p.name}.{uuid.uuid4().hex[:8]}.partial'
    partial.write_bytes(data)
    os.replace(partial, p)


def delete(p: epath.Path) -> None:
    """Removes file or object `p` if it is there."""
    try:
        p.unlink()
    except FileNotFoundError:
        pass


def files(folder: epath.Path) -> dict[str, int]:
    """Every file under `folder` (a path relative to it, sorted) and its size in bytes: one listing on
    an object store."""
    if is_remote(folder):
        return {relative: int(info['size']) for relative, info in _listing(folder).items()}
    return dict(
        sorted(
            (os.path.relpath(os.path.join(d, name), folder), os.path.getsize(os.path.join(d, name)))
            for d, _, names in os.walk(folder)
            for name in names
        )
    )


def names(folder: epath.Path) -> set[str]:
    """The names of the entries of `folder` (none if it is not there), on an object store listed anew:
    a long-lived reader (a notebook) sees what was written since its last listing."""
    if not is_remote(folder):
        return {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    fs, inner = _filesystem(folder)
    fs.invalidate_cache(inner)
    try:
        return {entry.rstrip('/').rsplit('/', 1)[-1] for entry in fs.ls(inner, detail=False)}
    except FileNotFoundError:
        return set()


def _listing(folder: epath.Path) -> dict[str, dict]:
    """Every object under remote `folder` (a path relative to it, sorted) and what the store says of
    it (size, generation, ...): one listing, never cached."""
    fs, inner = _filesystem(folder)
    fs.invalidate_cache(inner)
    return {name[len(inner.rstrip('/')) + 1 :]: info for name, info in sorted(fs.find(inner, detail=True).items())}


def matching(pattern: str) -> list[str]:
    """The files a remote folder holds, or a remote glob matches, as sorted URLs."""
    fs, inner = _filesystem(pattern)
    scheme = pattern.split('://', 1)[0]
    found = fs.find(inner) if fs.isdir(inner) else fs.glob(inner)
    return sorted(f'{scheme}://{f}' for f in found if not f.endswith('/'))


def copy_tree(
    source: epath.Path,
    target: epath.Path,
    last: tuple[str, ...] = (),
    known: dict[str, int] | None = None,
    wanted: Callable[[str], bool] = lambda relative: True,
) -> dict[str, int]:
    """Copies every file under folder `source` that `wanted` (its relative path) accepts to the same
    place under `target` (either may be remote), except those that the target holds at their size
    already: as `known` (relative path -> size) says, or, without it, as a local target's files
    are; returns the sizes of what `source` holds, the `known` of the next call. Each file is
    streamed in COPY_CHUNK pieces. The files whose names end with one of `last` go last, in that
    order: what marks a folder complete, so that a reader never takes a half-copied one for whole."""

    def order(relative: str) -> int:
        return next((i + 1 for i, name in enumerate(last) if relative.endswith(name)), 0)

    def held(relative: str) -> int | None:
        if known is not None:
            return known.get(relative)
        local = os.fspath(target / relative)
        return None if is_remote(target) or not os.path.isfile(local) else os.path.getsize(local)

    sizes = files(source)
    for relative in sorted(sizes, key=order):
        if wanted(relative) and held(relative) != sizes[relative]:
            _copy_file(source / relative, target / relative)
    return sizes


def _copy_file(source: epath.Path, target: epath.Path) -> None:
    """One file, streamed in COPY_CHUNK pieces (either side may be remote)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open('rb') as reader, target.open('wb') as writer:
        shutil.copyfileobj(reader, writer, COPY_CHUNK)


COPIED = '.vrl_copied.json'  # in a scratch copy: the version of each object it holds
COPY_SAID_BYTES = 64 << 20  # a copy down of at least this much is said, with its time (and a bar on a terminal)


def local_copy(folder: epath.Path, wanted: Callable[[str], bool] = lambda relative: True) -> epath.Path:
    """A local folder holding what remote `folder` holds (the files `wanted` accepts), for readers
    that open local files only (array_record, safetensors): the objects missing locally, or of
    another version (generation) than was copied, are copied down into this process's scratch,
    which records the versions it holds. A local `folder` is itself."""
    if not is_remote(folder):
        return folder
    local = scratch(folder)
    record = local / COPIED
    held = json.loads(record.read_text()) if record.exists() else {}
    listing = _listing(folder)
    now = {
        relative: f'{info["size"]}:{info.get("generation") or info.get("mtime")}' for relative, info in listing.items()
    }
    missing = [
        relative
        for relative, version in now.items()
        if wanted(relative) and (held.get(relative) != version or not (local / relative).exists())
    ]
    total, started = sum(int(listing[relative]['size']) for relative in missing), time.monotonic()
    said = total >= COPY_SAID_BYTES
    if said:
        print(f'copying {len(missing)} file(s), {total / 2**20:,.0f} MiB, of {folder} to {local}', flush=True)
    with tqdm.tqdm(total=total, unit='B', unit_scale=True, disable=None if said else True, mininterval=1.0) as bar:
        for relative in missing:
            _copy_file(folder / relative, local / relative)
            held[relative] = now[relative]
            bar.update(int(listing[relative]['size']))
    if said:
        print(f'copied {folder} in {time.monotonic() - started:.0f} s', flush=True)
    local.mkdir(parents=True, exist_ok=True)
    write_bytes(record, json.dumps(held).encode())
    return local


def put_file(local: str, target: epath.Path) -> None:
    """Moves local file `local` to `target`: a rename on local disk, an upload (then the local file
    removed) to an object store."""
    if not is_remote(target):
        os.replace(local, target)
        return
    fs, inner = _filesystem(target)
    fs.put_file(local, inner)
    os.remove(local)


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of file or object `url`: one ranged GET on an object store."""
    if not is_remote(url):
        with open(url, 'rb') as f:
            f.seek(start)
            return f.read(end - start)
    fs, inner = _filesystem(url)
    return fs.cat_file(inner, start, end)


def move(source: epath.Path, target: epath.Path) -> None:
    """Moves file or folder `source` to `target`: a rename locally; on an object store a copy of each
    object, then its removal (no object is lost if that stops half way)."""
    if not is_remote(source):
        os.replace(source, target)
        return
    fs, inner = _filesystem(source)
    _, inner_target = _filesystem(target)
    fs.mv(inner, inner_target, recursive=True)


def scratch(p: epath.Path) -> epath.Path:
    """A local folder that stands for remote `p` in this process's temp folder, created: the URL's
    path under TMPDIR/vrl-scratch/<scheme>/, so that the scratch of p / name is scratch(p) / name."""
    scheme, rest = str(p).split('://', 1)
    folder = epath.Path(tempfile.gettempdir()) / 'vrl-scratch' / scheme / rest.strip('/')
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def exists(p: epath.Path, what: str) -> bool:
    """Whether file or folder `p` is there. A bucket that does not exist, an unreachable store or
    missing credentials raise StorageError in one line naming `what` (e.g. 'data.tokenizer') and
    the path: there is nothing vrl could make there."""
    try:
        _check_reachable(p)
        if p.exists():
            return True
        if is_remote(p):
            fs, inner = _filesystem(p)
            bucket = inner.split('/', 1)[0]
            if not fs.exists(bucket):
                raise FileNotFoundError(f'404: bucket {bucket} not found')
        return False
    except Exception as e:  # noqa: BLE001 - every client raises its own kinds; each becomes one line
        raise StorageError(f'cannot read {what} {p} ({explain(e, p)})') from None


def check_writable(p: epath.Path, what: str, arrays: bool = False) -> None:
    """Creates folder `p` and proves it writable with a probe object, or raises StorageError in one
    line naming `what` (e.g. '--workdir'), the path and what to do. On an object store the probe is
    given up after `probe_timeout_s()` (a credential whose token never comes would keep gcsfs's
    retries going for minutes); `arrays`: TensorStore, Orbax's array writer, which fetches its own
    credentials, writes a probe too."""

    def probe() -> None:
        _check_reachable(p)
        p.mkdir(parents=True, exist_ok=True)
        written = p / f'.vrl_write_test.{uuid.uuid4().hex[:8]}'
        written.write_text('ok')
        written.unlink()

    try:
        within(probe_timeout_s(), probe) if is_remote(p) else probe()
    except Exception as e:  # noqa: BLE001 - every client raises its own kinds; each becomes one line
        raise StorageError(f'cannot write to {what} {p} ({explain(e, p)})') from None
    if arrays and str(p).startswith(('gs://', 'gcs://')):
        _check_tensorstore(p, what)


def _check_tensorstore(p: epath.Path, what: str) -> None:
    """A probe object written and removed by TensorStore under gs:// folder `p`, or StorageError."""
    import tensorstore as ts

    bucket, _, folder = str(p).split('://', 1)[1].partition('/')
    key = posixpath.join(folder, f'.vrl_write_test.{uuid.uuid4().hex[:8]}')
    context = ts.Context({'gcs_request_retries': {**tensorstore_retries(), 'max_retries': 2}})

    def probe() -> None:
        store = ts.KvStore.open({'driver': 'gcs', 'bucket': bucket}, context=context).result()
        store.write(key, b'ok').result()
        store.delete_range(ts.KvStore.KeyRange(key, key + '\0')).result()

    try:
        within(probe_timeout_s(), probe)
    except Exception as e:  # noqa: BLE001 - TensorStore's errors are ValueErrors with a status in the text
        cause = ' '.join(str(e).split())[:200]
        raise StorageError(
            f"cannot write checkpoints to {what} {p}: TensorStore, the checkpoints' array writer, failed "
            f"({cause}). It reads its credentials from GOOGLE_APPLICATION_CREDENTIALS, gcloud's "
            'application-default login or, on a Cloud VM, the metadata server (GCE_METADATA_ROOT): check '
            f'that the one in use answers (VRL_STORE_TIMEOUT_S={request_timeout_s():g} s a request)'
        ) from None


def probe_timeout_s() -> float:
    """Seconds `check_writable`'s probe of a store may take in all, its client's retries and
    credential look-ups included: 3 x request_timeout_s()."""
    return 3 * request_timeout_s()


def _bound_orbax_retries() -> None:
    """Orbax opens every array with a TensorStore context made from its own defaults (tensorstore_utils'
    base contexts; no option passes one in): tensorstore_retries() goes into those defaults."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    for defaults in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
        defaults.setdefault('gcs_request_retries', tensorstore_retries())


def tensorstore_retries() -> dict[str, int | str]:
    """TensorStore's retry policy for GCS requests, its credential's token fetch among them: as
    gcsfs's, 6 tries, with backoff from 1 s to request_timeout_s() (each try ends after
    request_timeout_s() without a byte), so a request that never gets an answer fails within about
    12 request_timeout_s(). TensorStore's default, 32 tries up to 32 s apart, held a first save ~15
    minutes on a token endpoint that never answered."""
    return {'max_retries': 6, 'initial_delay': '1s', 'max_delay': f'{request_timeout_s():g}s'}


def _check_reachable(p: epath.Path) -> None:
    """Raises ConnectionError at once when the endpoint serving gs:// path `p` refuses or does not
    answer a TCP connection: gcsfs would retry each request with backoff for about half a minute
    before saying so."""
    if is_remote(p):
        fs, _ = _filesystem(p)
        endpoint = getattr(fs, '_location', None)  # gcsfs: the emulator's or storage.googleapis.com
        if isinstance(endpoint, str):
            _connect(endpoint)


@functools.lru_cache(maxsize=None)
def _connect(endpoint: str, timeout_seconds: float = 10.0) -> None:
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == 'https' else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_seconds).close()
    except OSError as e:
        _connect.cache_clear()  # a later call tries again
        raise ConnectionError(f'cannot connect to {url.hostname}:{port}: {e}') from None


def explain(e: BaseException, p: epath.Path) -> str:
    """What went wrong touching `p`, and what to do, in a few words."""
    text = ' '.join(str(e).split())
    if not is_remote(p):
        return f'{getattr(e, "strerror", None) or text}; choose a writable path'
    bucket = str(p).split('://', 1)[1].split('/', 1)[0]
    if isinstance(e, TimeoutError) and text.startswith('no answer in'):  # `within`'s: nothing came back
        return (
            f'{text} from the object store or from the token endpoint of its credentials: check the network, '
            'STORAGE_EMULATOR_HOST and the credentials in use (GOOGLE_APPLICATION_CREDENTIALS, '
            '`gcloud auth application-default login`, or on a Cloud VM its metadata server)'
        )
    lowered = text.lower()
    status = {int(code) for code in re.findall(r'\b(40[134])\b', text)}  # not a port that holds the digits
    if 'credentials' in lowered or 'refresh' in lowered or 'unauthenticated' in lowered or 401 in status:
        return (
            'no credentials for the object store: on a Cloud VM give its service account access to the '
            'bucket; elsewhere run `gcloud auth application-default login` or set '
            'GOOGLE_APPLICATION_CREDENTIALS'
        )
    if 403 in status or 'forbidden' in lowered or 'permission' in lowered:
        return f'permission denied on bucket {bucket}: grant this account Storage Object Admin on it'
    if 404 in status or 'not found' in lowered or 'nosuchbucket' in lowered or isinstance(e, FileNotFoundError):
        return (
            f'bucket {bucket} does not exist: create it (gcloud storage buckets create gs://{bucket}) or fix the path'
        )
    if 'connect' in lowered or 'timeout' in lowered or 'unreachable' in lowered:
        return f'the object store cannot be reached ({text[:160]}): check the network or STORAGE_EMULATOR_HOST'
    return text[:300]


class _SayRetries(logging.Filter):
    """Of gcsfs's log, only its retries, each one warning line: a wait on the store is never silent."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if 'retrying after exception' not in text:
            return False
        cause = ' '.join(text.split('exception:', 1)[1].split())[:200] or 'no answer in time'
        record.msg, record.args = 'a request to the object store failed (%s); retrying', (cause,)
        record.levelno, record.levelname = logging.WARNING, 'WARNING'
        return True


def within(seconds: float, fn: Callable[[], T]) -> T:
    """fn(), given up after `seconds` (TimeoutError): for what must notice a store that stopped
    answering sooner than its client's retries would (6 tries, each up to request_timeout_s()). An
    abandoned call finishes or fails on its own thread."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        try:
            outcome.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.set_exception(e)

    threading.Thread(target=call, name='vrl-store-call', daemon=True).start()
    try:
        return outcome.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f'no answer in {seconds:g} s') from None


def request_timeout_s() -> float:
    """VRL_STORE_TIMEOUT_S, or REQUEST_TIMEOUT_S; StorageError for a value that is not seconds."""
    text = os.environ.get('VRL_STORE_TIMEOUT_S', '')
    try:
        seconds = float(text) if text else REQUEST_TIMEOUT_S
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise StorageError(
            f'VRL_STORE_TIMEOUT_S={text!r}: give the seconds a request to the object store may wait, '
            f'e.g. {REQUEST_TIMEOUT_S:.0f}'
        )
    return seconds


@functools.cache
def _configure_clients() -> None:
    """Once per process, before a client is made: every request to the store is bounded by
    REQUEST_TIMEOUT_S (gcsfs: aiohttp's connect and read timeouts, then its retries; TensorStore,
    Orbax's writer: curl's connect timeout and its abort below 1 byte/s); gcsfs's log says each
    retry in one line and nothing else (it warns per call when it cannot tell a bucket's type, and
    logs a traceback when a request runs out of retries): vrl reports what failed in its own one
    line (`explain`). Against an emulator (STORAGE_EMULATOR_HOST), which takes no credentials, gcsfs
    looks none up."""
    gcsfs_log = logging.getLogger('gcsfs')
    gcsfs_log.setLevel(logging.DEBUG)  # for its retries, which _SayRetries alone lets through
    gcsfs_log.addFilter(_SayRetries())
    import aiohttp
    import fsspec

    timeout_s = request_timeout_s()
    seconds = str(max(1, round(timeout_s)))
    for name in ('TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS', 'TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS'):
        os.environ.setdefault(name, seconds)
    os.environ.setdefault('TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES', '1')
    _bound_orbax_retries()
    gcs = fsspec.config.conf.setdefault('gcs', {})
    gcs.setdefault(
        'requests_timeout', aiohttp.ClientTimeout(total=5 * timeout_s, sock_connect=timeout_s, sock_read=timeout_s)
    )
    if os.environ.get('STORAGE_EMULATOR_HOST'):
        gcs.setdefault('token', 'anon')
        os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')  # no gRPC probe: emulators have none
