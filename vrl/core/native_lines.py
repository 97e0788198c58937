"""Lines that native libraries write straight to file descriptors 1 and 2 and that tell a user
nothing, with no setting of their own to quiet them:

- Gloo (JAX's collectives between CPU processes, as in a pod rehearsed on one machine) prints
  `[Gloo] Rank R is connected to N peer ranks. Expected number of connected peer ranks is : N`
  on its standard output at every connection;
- TensorStore (Orbax's array writer) logs, at error level, that no gcloud credentials file exists,
  on its way to the credentials it then finds (a TPU VM's metadata server).

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

NOISE = {  # per stream: what is dropped, each a whole line without its newline
    'stdout': re.compile(rb'\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. '
                         rb'Expected number of connected peer ranks is : \1'),
    'stderr': re.compile(rb'[IWE]\d{4} [\d:.]+ +\d+ google_auth_provider\.cc:\d+\] '
                         rb'(Could not find the credentials file in the standard gcloud location \[.*\]\. You may '
                         rb'specify a credentials file using \$GOOGLE_APPLICATION_CREDENTIALS, or to use Google '
                         rb'application default credentials, run: gcloud auth application-default login'
                         rb'|Using GOOGLE_AUTH_TOKEN_FOR_TESTING)'),
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
    subprocess.Popen([sys.executable, '-m', 'vrl.core.native_lines', *map(str, read_ends)], pass_fds=read_ends,
                     stdin=subprocess.DEVNULL, stdout=targets[0], stderr=targets[1])
    for fd in (*targets, *read_ends):
        os.close(fd)


def pass_on(source: int, target: int, noise: re.Pattern[bytes]) -> None:
    """Copies `source` to `target` line by line until end of file, leaving out lines `noise` matches;
    once `target` is gone (its reader closed it), reads on, so that no writer ever blocks."""
    pending = b''
    while chunk := os.read(source, 1 << 16):
        *lines, pending = (pending + chunk).split(b'\n')
        _write(target, b''.join(line + b'\n' for line in lines if not noise.fullmatch(line)))
    if not noise.fullmatch(pending):
        _write(target, pending)


def _write(target: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(target, data):]
    except OSError:  # a closed terminal or pipe: what follows has nowhere to go
        pass


def _serve(read_ends: list[int]) -> None:
    """The child: one thread per pipe, onto its own descriptor 1 or 2; deaf to the signals that a
    terminal or a scheduler sends the whole process group, so that it drains the pipes after the
    run has stopped."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    threads = [threading.Thread(target=pass_on, args=(source, target, noise))
               for target, (source, noise) in enumerate(zip(read_ends, NOISE.values()), 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == '__main__':
    _serve([int(fd) for fd in sys.argv[1:]])
