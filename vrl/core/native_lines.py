"""Lines that native libraries write straight to file descriptors 1 and 2 and that tell a user
nothing, with no setting of their own to quiet them:

- Gloo (JAX's collectives between CPU processes, as in a pod rehearsed on one machine) prints
  `[Gloo] Rank R is connected to N peer ranks. Expected number of connected peer ranks is : N`
  on its standard output at every connection, two ranks' lines at times interleaved;
- TensorStore (Orbax's array writer) logs, at error level, that no gcloud credentials file exists,
  on its way to the credentials it then finds (a TPU VM's metadata server);
- when process 0 of a job dies, the coordination service it hosts goes with it, and JAX's client on
  every other process aborts at once (its error callback cannot be given from Python) with a few
  lines of gRPC errors, a C++ stack and Python's thread dump; when a process of the job never
  joins, every other aborts the same way after the join timeout. `JaxAbort` puts one line in their
  place, naming the cause; the process still ends by the abort (exit status 134).

`quiet()` gives Python's `sys.stdout` and `sys.stderr` copies of descriptors 1 and 2, so that
vrl's lines and progress bars go to the terminal as before, and points 1 and 2, where C and C++
write, at pipes read by a child process (`python -m vrl.core.native_lines`). The child passes on
every line but those above, byte for byte, and ends when every writer has closed its pipes: a
native crash's last lines still arrive. A line that differs (Gloo connected to fewer peers than
expected, any other credentials message) passes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading


class Drop:
    """Drops the whole lines that `pattern` matches."""

    def __init__(self, pattern: bytes):
        self.pattern = re.compile(pattern)

    def feed(self, line: bytes) -> list[bytes]:
        """The lines to pass on, given the next one (each without its newline)."""
        return [] if self.pattern.fullmatch(line) else [line]

    def end(self) -> list[bytes]:
        """The lines held back, passed on at end of file."""
        return []


class GlooLines:
    """Drops Gloo's connection lines. The ranks of one process (one per local device) connect on
    threads that write into one C stdio buffer a token at a time, so two ranks' lines can interleave
    at any token, e.g. `[Gloo] Rank [Gloo] Rank 0 is connected ... : 3` then `1 is connected ... : 3`,
    or one whole message running into the next, whose two newlines follow (an empty line). A run of
    lines made only of Gloo's tokens, and the empty lines that end its messages, is held until every
    message begun in it has ended, then dropped if every peer count in it (connected, expected) is
    the same number, else passed whole."""

    TOKENS = re.compile(
        rb'(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. '
        rb'|Expected number of connected peer ranks is : )+'
    )
    START = b'[Gloo] Rank '
    COUNT = re.compile(rb'(?: is connected to |peer ranks is : )(\d+)')

    def __init__(self):
        self.held: list[bytes] = []
        self.unended = 0  # messages begun in `held` whose newline has not come

    def feed(self, line: bytes) -> list[bytes]:
        starts = line.count(self.START)
        ends_one = not line and self.unended  # the newline of a message that ran into the next
        if not ends_one and (not self.TOKENS.fullmatch(line) or not (starts or self.held)):
            return self.end() + [line]
        self.held.append(line)
        self.unended += starts - 1
        if self.unended:
            return []
        held, self.held = self.held, []
        return [] if len(set(self.COUNT.findall(b' '.join(held)))) == 1 else held

    def end(self) -> list[bytes]:
        held, self.held, self.unended = self.held, [], 0
        return held


class JaxAbort:
    """Replaces the abort of a process that JAX's coordination service client stops (process 0 gone,
    or the job not joined in time) with one line saying which. The lines of the two sources that log on
    the way to it (the preemption notice, the polled error) are held until the next line from
    elsewhere, then passed on; the abort's own lines, read up to its stack trace, say its cause, and
    everything after them is dropped."""

    LEADER_LOST = (
        b'error: process 0 stopped answering: the coordination service it hosts is gone (its host died or froze)'
    )
    NOT_JOINED = (
        b'error: not every process joined the job within --join_timeout_s: start each of them with the '
        b'same --coordinator_address and --num_processes, and its own --process_id'
    )
    PREFIX = re.compile(rb'[IWEF]\d{4} [\d:.]+ +\d+ ')
    ON_THE_WAY = re.compile(rb'[IWEF]\d{4} [\d:.]+ +\d+ (preemption_sync_manager|coordination_service_agent)\.cc:')
    ABORT = re.compile(
        rb'F\d{4} [\d:.]+ +\d+ client\.h:\d+\] Terminating process because the JAX distributed '
        rb'service detected fatal errors\..*absl::Status: (.*)'
    )

    def __init__(self):
        self.held: list[bytes] = []
        self.cause: list[bytes] | None = None  # the abort's lines, once it began
        self.said = False

    def feed(self, line: bytes) -> list[bytes]:
        if self.cause is not None:
            if self.said or not line.startswith(b'*** Check failure'):
                self.cause.append(line)
                return []
            self.said = True
            return [self._line()]
        if found := self.ABORT.fullmatch(line):
            self.held, self.cause = [], [found.group(1)]
            return []
        if self.ON_THE_WAY.match(line) or (self.held and not self.PREFIX.match(line)):
            self.held.append(line)
            return []
        return self.end() + [line]

    def _line(self) -> bytes:
        cause = b' '.join(self.cause or [])
        if b'RegisterTask' in cause:  # the join's call: its deadline passed, or process 0 gave up first
            return self.NOT_JOINED
        if b'Failed to send RPC to coordination service' in cause:
            return self.LEADER_LOST
        return b'error: the JAX distributed service stopped this process: ' + b' '.join(cause.split())[:300]

    def end(self) -> list[bytes]:
        if self.cause is not None:
            return [] if self.said else [self._line()]
        held, self.held = self.held, []
        return held


class Both:
    """Lines through two filters in turn."""

    def __init__(self, first: Drop | GlooLines | JaxAbort, second: Drop | GlooLines | JaxAbort):
        self.first, self.second = first, second

    def feed(self, line: bytes) -> list[bytes]:
        return [kept for passed in self.first.feed(line) for kept in self.second.feed(passed)]

    def end(self) -> list[bytes]:
        return [kept for passed in self.first.end() for kept in self.second.feed(passed)] + self.second.end()


NOISE = {  # per stream, what drops its lines
    'stdout': GlooLines,
    'stderr': lambda: Both(
        JaxAbort(),
        Drop(
            rb'[IWE]\d{4} [\d:.]+ +\d+ google_auth_provider\.cc:\d+\] '
            rb'(Could not find the credentials file in the standard gcloud location \[.*\]\. You may '
            rb'specify a credentials file using \$GOOGLE_APPLICATION_CREDENTIALS, or to use Google '
            rb'application default credentials, run: gcloud auth application-default login'
            rb'|Using GOOGLE_AUTH_TOKEN_FOR_TESTING)'
        ),
    ),
}


def quiet() -> None:
    """Filters descriptors 1 and 2 through the child process from here to the process's end."""
    targets, read_ends = [], []
    for fd, name in enumerate(NOISE, 1):  # 1: stdout, 2: stderr
        stream = getattr(sys, name)
        stream.flush()
        targets.append(os.dup(fd))
        python_side = open(os.dup(fd), 'w', encoding=stream.encoding, errors=stream.errors)
        python_side.reconfigure(line_buffering=stream.line_buffering, write_through=stream.write_through)
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        read_ends.append(read_end)
        setattr(sys, name, python_side)
    # the child's own 1 and 2 are the original ones; it holds no write end of its pipes
    subprocess.Popen(
        [sys.executable, '-m', 'vrl.core.native_lines', *map(str, read_ends)],
        pass_fds=read_ends,
        stdin=subprocess.DEVNULL,
        stdout=targets[0],
        stderr=targets[1],
    )
    for fd in (*targets, *read_ends):
        os.close(fd)


def pass_on(source: int, target: int, noise: Drop | GlooLines | Both) -> None:
    """Copies `source` to `target` line by line until end of file, leaving out the lines `noise`
    drops, and a last line without newline as it is; once `target` is gone (its reader closed it),
    reads on, so that no writer ever blocks."""
    pending = b''
    while chunk := os.read(source, 1 << 16):
        *lines, pending = (pending + chunk).split(b'\n')
        _write(target, b''.join(kept + b'\n' for line in lines for kept in noise.feed(line)))
    _write(target, b''.join(kept + b'\n' for kept in noise.end()) + pending)


def _write(target: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(target, data) :]
    except OSError:  # a closed terminal or pipe: what follows has nowhere to go
        pass


def _serve(read_ends: list[int]) -> None:
    """The child: one thread per pipe, onto its own descriptor 1 or 2; deaf to the signals that a
    terminal or a scheduler sends the whole process group, so that it drains the pipes after the
    run has stopped."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    threads = [
        threading.Thread(target=pass_on, args=(source, target, noise()))
        for target, (source, noise) in enumerate(zip(read_ends, NOISE.values()), 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == '__main__':
    _serve([int(fd) for fd in sys.argv[1:]])
