"""A slow object store on 127.0.0.1: a TCP proxy in front of the GCS emulator that behaves as a
real bucket does from a VM, for the tests and bench/.

The emulator answers in microseconds from local disk; a bucket takes tens of milliseconds a
request and has a bandwidth per connection. The proxy delays every chunk a client sends by
`latency_s` (a request is one chunk or a few; the delay is counted from its arrival, so requests
in flight on other connections overlap as they would) and paces what the store sends back at
`bandwidth` bytes/s per connection. It counts the requests and the bytes it served, so a test can
say how much a reader fetched.

    python -m tests.slow_store --upstream=http://127.0.0.1:4443 --latency_ms=50 --mbps=50
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import urllib.parse

CHUNK = 64 << 10


class SlowStore:
    """Serves `upstream` (http://127.0.0.1:PORT) at `url`, slowed; `start()` runs it in a thread."""

    def __init__(self, upstream: str, latency_s: float = 0.05, bandwidth: float = 50e6):
        parts = urllib.parse.urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self.latency_s, self.bandwidth = latency_s, bandwidth
        self.requests = 0  # chunks sent by clients: about one per request
        self.bytes_served = 0  # bytes sent back to clients
        self.url = ''
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> SlowStore:
        ready = threading.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._connection, '127.0.0.1', 0)
            self.url = f'http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}'
            ready.set()

        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        if not ready.wait(10):
            raise RuntimeError('the slow store did not start')
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await asyncio.gather(*self._connections, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def __enter__(self) -> SlowStore:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections.add(asyncio.current_task())
        self._writers.add(client_writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()
            return
        self._writers.add(upstream_writer)
        pumps = [asyncio.ensure_future(self._requests(client_reader, upstream_writer)),
                 asyncio.ensure_future(self._responses(upstream_reader, client_writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for writer in (client_writer, upstream_writer):
            writer.close()
            self._writers.discard(writer)
        self._connections.discard(asyncio.current_task())

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Client -> store: each chunk forwarded `latency_s` after it arrived, in order."""
        while chunk := await _read(reader):
            self.requests += 1
            due = time.monotonic() + self.latency_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if not await _write(writer, chunk):
                return

    async def _responses(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Store -> client, paced at `bandwidth` bytes/s on this connection (an idle connection
        earns no credit)."""
        free_at = time.monotonic()
        while chunk := await _read(reader):
            self.bytes_served += len(chunk)
            free_at = max(free_at, time.monotonic()) + len(chunk) / self.bandwidth
            await asyncio.sleep(max(0.0, free_at - time.monotonic()))
            if not await _write(writer, chunk):
                return

async def _read(reader: asyncio.StreamReader) -> bytes:
    """The next chunk, or b'' when the connection ended (closed or reset)."""
    try:
        return await reader.read(CHUNK)
    except OSError:
        return b''


async def _write(writer: asyncio.StreamWriter, chunk: bytes) -> bool:
    """Whether `chunk` was sent (False: the other side is gone)."""
    try:
        writer.write(chunk)
        await writer.drain()
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--upstream', required=True, help='the emulator, e.g. http://127.0.0.1:4443')
    parser.add_argument('--latency_ms', type=float, default=50)
    parser.add_argument('--mbps', type=float, default=50, help='megabytes per second per connection')
    args = parser.parse_args()
    with SlowStore(args.upstream, args.latency_ms / 1e3, args.mbps * 1e6) as store:
        print(f"export STORAGE_EMULATOR_HOST='{store.url}'\n# serving {args.upstream} slowed; Ctrl-C stops", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == '__main__':
    main()
