"""Who has come, while a job of several processes forms. jax.distributed's join is one barrier that
says nothing until its timeout, and then not who was missing; the roll call is a side channel that
does. Process 0 listens at the coordinator's address, on the port after its (coordinator port + 1), every other
process connects to it and gives its index. While some have not come, process 0 says which, and
a process that cannot reach process 0 says that, each every `every_s` seconds (30 s, or a quarter
of --join_timeout_s if that is shorter), until jax.distributed's join returns or times out.

The roll call only informs: a port in use or a process that cannot reach it never stops the join,
which succeeds or fails on its own."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

REPORT_EVERY_S = 30.0  # at most; a quarter of the join timeout if that is shorter
_RETRY_S = 0.5  # between one process's tries to reach process 0


def report_every(join_timeout_s: float) -> float:
    """Seconds between two roll-call lines for a join that may take `join_timeout_s`."""
    return min(REPORT_EVERY_S, join_timeout_s / 4)


def _numbers(indices: list[int]) -> str:
    return ', '.join(map(str, indices))


def _port_after(coordinator: str) -> tuple[str, int]:
    host, port = coordinator.rsplit(':', 1)
    return host.strip('[]'), int(port) + 1


def _listen(
    host: str, port: int, num_processes: int, every_s: float, done: threading.Event, say: Callable[[str], None]
) -> None:
    """Listens at the coordinator's address only (the one the other processes connect to), not on every
    interface of process 0's host."""
    try:
        server = socket.create_server((host, port), family=_family(host), reuse_port=False)
    except OSError as e:
        say(
            f'process 0 of {num_processes}: no roll call ({host}:{port} cannot be listened at: {e.strerror}); the '
            'join goes on, without saying who is missing'
        )
        return
    server.settimeout(_RETRY_S)
    came = {0}
    next_report = time.monotonic() + every_s
    with server:
        while not done.is_set() and len(came) < num_processes:
            try:
                connection, _ = server.accept()
                with connection:
                    connection.settimeout(5)
                    index = int(connection.recv(32).decode().strip() or -1)
                if 0 < index < num_processes:
                    came.add(index)
            except (TimeoutError, OSError, ValueError):
                pass
            if time.monotonic() >= next_report and not done.is_set() and len(came) < num_processes:
                missing = sorted(set(range(num_processes)) - came)
                say(
                    f'process 0 of {num_processes}: still waiting for process{"es" if len(missing) > 1 else ""} '
                    f'{_numbers(missing)} to join (here: {_numbers(sorted(came))})'
                )
                next_report += every_s


def _family(host: str) -> socket.AddressFamily:
    """IPv6 for an address written with colons ([::1] in a coordinator address), else IPv4."""
    return socket.AF_INET6 if ':' in host else socket.AF_INET


def _answer(
    host: str,
    port: int,
    process_id: int,
    num_processes: int,
    every_s: float,
    done: threading.Event,
    say: Callable[[str], None],
) -> None:
    started = time.monotonic()
    next_report = started + every_s
    while not done.is_set():
        try:
            with socket.create_connection((host, port), timeout=_RETRY_S) as connection:
                connection.sendall(f'{process_id}\n'.encode())
            return
        except OSError:
            pass
        if time.monotonic() >= next_report and not done.is_set():
            say(
                f'process {process_id} of {num_processes}: process 0 has not answered at {host}:{port} for '
                f'{time.monotonic() - started:.0f} s: is it started, at that address?'
            )
            next_report += every_s
        done.wait(_RETRY_S)


def start(
    coordinator: str, num_processes: int, process_id: int, every_s: float, say: Callable[[str], None]
) -> Callable[[], None]:
    """Begins this process's part of the roll call for the job whose coordinator is `coordinator`
    (host:port). Returns the function that ends it (once the join has returned or failed)."""
    host, port = _port_after(coordinator)
    done = threading.Event()
    if process_id == 0:
        target, arguments = _listen, (host, port, num_processes, every_s, done, say)
    else:
        target, arguments = _answer, (host, port, process_id, num_processes, every_s, done, say)
    thread = threading.Thread(target=target, args=arguments, name='vrl-roll-call', daemon=True)
    thread.start()

    def end() -> None:
        done.set()
        thread.join(timeout=5)

    return end
