"""A slow, faulty object store on 127.0.0.1: a TCP proxy in front of the GCS emulator that behaves
as a real bucket does from a VM, for the tests and bench/.

The emulator answers in microseconds from local disk; a bucket takes tens of milliseconds a
request and has a bandwidth per connection. The proxy delays every chunk a client sends by
`latency_s` (a request is one chunk or a few; the delay is counted from its arrival, so requests
in flight on other connections overlap as they would) and paces what the store sends back at
`bandwidth` bytes/s per connection. It counts the requests and the bytes it received and served, so
a test can say how much a writer sent and a reader fetched.

`hold()` and `release()` stop and restart the traffic both ways (a store that stops answering, a
client whose traffic is frozen): every answer, and every request from its start (a request the store
has begun to read is read to its end, as a real store does). It also injects the faults a real store has, on the
requests a `Fault`'s pattern matches (a regex
over the start of the request: its line, headers and the first bytes of its body, where a GCS
upload names its object): an answer of 503, a connection reset, a stall (the request is never
answered; the client must time out), or a hold: from that request on, every byte both ways is held as
by `hold()` (`held` is set), until `release()` lets it all go on in order (a client frozen mid-write
whose writes land later).

    python -m tests.slow_store --upstream=http://127.0.0.1:4443 --latency_ms=50 --mbps=50
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import socket
import struct
import threading
import time
import urllib.parse

CHUNK = 64 << 10
REQUEST_START = re.compile(rb'^(GET|POST|PUT|DELETE|PATCH|HEAD) /')
UNAVAILABLE = (
    b'HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n'
    b'Content-Length: 62\r\n\r\n{"error": {"code": 503, "message": "injected: backend error"}}'
)


@dataclasses.dataclass
class Fault:
    """`kind` ('503', 'reset', 'stall' or 'hold') for the first `times` requests whose start matches `pattern`."""

    pattern: str
    kind: str
    times: int = 1
    injected: int = 0  # how many so far

    def __post_init__(self):
        assert self.kind in ('503', 'reset', 'stall', 'hold'), self.kind

    def takes(self, start: bytes) -> bool:
        if self.injected < self.times and re.search(self.pattern.encode(), start):
            self.injected += 1
            return True
        return False


class SlowStore:
    """Serves `upstream` (http://127.0.0.1:PORT) at `url`, slowed; `start()` runs it in a thread."""

    def __init__(self, upstream: str, latency_s: float = 0.05, bandwidth: float = 50e6, faults: tuple[Fault, ...] = ()):
        parts = urllib.parse.urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self.latency_s, self.bandwidth, self.faults = latency_s, bandwidth, list(faults)
        self.requests = 0  # chunks sent by clients: about one per request
        self.bytes_served = 0  # bytes sent back to clients
        self.bytes_received = 0  # bytes clients sent: requests and what they upload
        self.request_lines: list[str] = []  # 'GET /storage/v1/b/...', in the order they came
        self.url = ''
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()  # cleared while `hold` holds every byte, both ways
        self._flowing.set()
        self.held = threading.Event()  # set once a 'hold' fault has held the traffic

    def hold(self) -> None:
        """From now on no byte passes either way (a store that stopped answering) until `release`;
        the connections stay open."""
        asyncio.run_coroutine_threadsafe(self._set_flowing(False), self._loop).result(10)

    def release(self) -> None:
        """What `hold` held goes on, in order."""
        asyncio.run_coroutine_threadsafe(self._set_flowing(True), self._loop).result(10)

    async def _set_flowing(self, flowing: bool) -> None:
        self._flowing.set() if flowing else self._flowing.clear()

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
        pumps = [
            asyncio.ensure_future(self._requests(client_reader, upstream_writer, client_writer)),
            asyncio.ensure_future(self._responses(upstream_reader, client_writer)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for writer in (client_writer, upstream_writer):
            writer.close()
            self._writers.discard(writer)
        self._connections.discard(asyncio.current_task())

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: asyncio.StreamWriter
    ) -> None:
        """Client -> store: each chunk forwarded `latency_s` after it arrived, in order; a request that
        a fault takes is answered with it instead (and the connection ends). A hold stops requests at
        their start: the rest of a request the store has begun to read goes on, as a real store
        reads what it was sent (the emulator would otherwise wait on the body, blocking other
        clients of the bucket); its answer is held."""
        while chunk := await _read(reader):
            self.requests += 1
            self.bytes_received += len(chunk)
            due = time.monotonic() + self.latency_s
            starts = bool(REQUEST_START.match(chunk))
            if starts:
                self.request_lines.append(chunk.split(b'\r\n', 1)[0].decode(errors='replace'))
            fault = next((f for f in self.faults if starts and f.takes(chunk)), None)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if fault is not None and fault.kind == 'hold':
                self._flowing.clear()
                self.held.set()
            elif fault is not None:
                await self._inject(fault.kind, reader, client)
                return
            if starts:
                await self._flowing.wait()
            if not await _write(writer, chunk):
                return

    @staticmethod
    async def _inject(kind: str, reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        if kind == '503':
            await _write(client, UNAVAILABLE)
        elif kind == 'reset':  # close with SO_LINGER 0: the client reads a TCP reset
            client.get_extra_info('socket').setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
        else:  # a stall: never answered; the connection ends when the client gives up
            while await _read(reader):
                pass

    async def _responses(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Store -> client, paced at `bandwidth` bytes/s on this connection (an idle connection
        earns no credit). The store's bytes are read as it sends them, held or not, as a real store
        sends into its network: a client that is held never blocks the store (the emulator would
        block every other client on the write)."""
        arrived: asyncio.Queue[bytes] = asyncio.Queue()

        async def take() -> None:
            while chunk := await _read(reader):
                self.bytes_served += len(chunk)
                arrived.put_nowait(chunk)
            arrived.put_nowait(b'')

        taking = asyncio.ensure_future(take())
        free_at = time.monotonic()
        try:
            while chunk := await arrived.get():
                free_at = max(free_at, time.monotonic()) + len(chunk) / self.bandwidth
                await asyncio.sleep(max(0.0, free_at - time.monotonic()))
                await self._flowing.wait()
                if not await _write(writer, chunk):
                    return
        finally:
            taking.cancel()


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
    parser.add_argument(
        '--fault',
        action='append',
        default=[],
        metavar='KIND:TIMES:PATTERN',
        help='e.g. 503:3:metrics\\.jsonl, reset:2:checkpoints, stall:1:config\\.json (repeatable)',
    )
    args = parser.parse_args()
    faults = [Fault(pattern, kind, int(times)) for kind, times, pattern in (f.split(':', 2) for f in args.fault)]
    with SlowStore(args.upstream, args.latency_ms / 1e3, args.mbps * 1e6, faults) as store:
        print(f"export STORAGE_EMULATOR_HOST='{store.url}'\n# serving {args.upstream} slowed; Ctrl-C stops", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == '__main__':
    main()
