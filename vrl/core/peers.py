"""The processes of a job watch each other, so that one process's failure stops every process
within seconds, each saying what stopped the job in one line.

Left to jax.distributed, a process that raises outside a collective leaves the others waiting in
their next collective (an all-gather, a train step) until its shutdown barrier gives up, 5 minutes
later, with native stack dumps and the cause printed only on the failed process. So:

- A process whose command fails (`stop`) publishes `process i: <its error in one line>` in the
  coordination service's key-value store (the first failure wins) and ends at once (exit 1),
  skipping the shutdown barrier that would wait for the others. Process 0, which hosts the
  coordination service, ends last: once every other process has seen the failure (a process left
  without the service aborts with a native stack dump).
- A watcher thread on each process polls for a failure every POLL_S. Seeing one, it runs what the
  process registered for that case (`on_stop`: process 0 releases the workdir's lease), prints
  `error: process i stopped: ...` and ends the process (exit 1), though its main thread may be
  waiting in a collective that will never complete.
- Liveness: each watcher counts up a key of its own every POLL_S. Process 0 reads every count at
  once; a process whose count has not moved for `timeout_s` (a host that died outright, or froze)
  is published as failed, which stops the others. The other processes watch process 0's count, and
  stop when the coordination service (process 0's) stops answering. A process that ends normally
  says so first (`finish`), so that a finished process is not taken for a dead one.

Errors every process already agreed on (multihost.everywhere's) end the usual way, through the
shutdown barrier. A job of one process watches nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

import jax

POLL_S = 1.0  # how often a watcher looks for a failure and counts up
SILENT_S = 3 * POLL_S  # a failed process's look for a peer that stopped answering, the likelier cause
ACK_WAIT_S = 5.0  # how long process 0 waits for the others to see a failure before it ends
EXIT_GRACE_S = 0.5  # and then for them to end
_FAILED = 'vrl/failed'  # the first failure's line
_SEEN = 'vrl/seen/'  # a key per process that has seen it
_ALIVE = 'vrl/alive/'  # a count per process
_DONE = 'vrl/done/'  # a key per process that ended normally

_watcher: _Watcher | None = None


def watch(client: Any, timeout_s: float) -> None:
    """Starts this process's watcher on jax.distributed's `client` (several processes only)."""
    global _watcher
    if jax.process_count() > 1 and _watcher is None:
        _watcher = _Watcher(client, timeout_s)
        atexit.register(finish)  # after jax's own atexit handler was registered: runs before it


def watching() -> bool:
    """Whether this process watches others (a job of several processes)."""
    return _watcher is not None


def on_stop(action: Callable[[], None]) -> Callable[[], None]:
    """Runs `action` if another process's failure stops this one (not when this process's own error
    unwinds its stack: its `finally` blocks do that). Returns a function that unregisters it."""
    if _watcher is None:
        return lambda: None
    _watcher.actions.append(action)
    return lambda: _watcher.actions.remove(action) if action in _watcher.actions else None


def stop(line: str, say: Callable[[], None]) -> None:
    """This process failed with `line` (its error in one line): tell every process and end now,
    saying what stopped the job: this failure (`say()` prints it as the process would alone), or
    the one another process published first, or a peer that stopped answering, of which this
    failure is the consequence (a collective whose peer is gone). Does nothing on a job of one
    process (the caller ends as usual)."""
    if _watcher is not None:
        _watcher.fail(f'process {jax.process_index()}: {line}', own=True, say=say)


def abort(line: str) -> None:
    """Ends this process (exit 1) for a failure found off its main thread, which may be waiting on
    what failed: prints `error: <line>`; on a job of several, tells the others first (`stop`)."""
    say = lambda: print(f'error: {line}', file=sys.stderr, flush=True)  # noqa: E731
    stop(line, say)
    say()
    sys.stdout.flush()
    os._exit(1)


def finish() -> None:
    """This process ends normally: its watcher stops, and its silence is not a death."""
    global _watcher
    if _watcher is not None:
        _watcher.close()
        _watcher = None


class _Watcher:
    def __init__(self, client: Any, timeout_s: float):
        self._client, self._timeout_s = client, timeout_s
        self._index, self._count = jax.process_index(), jax.process_count()
        self.actions: list[Callable[[], None]] = []
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name='vrl-peers', daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beats, last_moved = {}, {}  # process -> (its count, when it last moved on this clock)
        while True:
            try:
                self._client.key_value_increment(f'{_ALIVE}{self._index}', 1)
                failed = self._try_get(_FAILED)
                if failed is not None:
                    self.fail(failed, own=False)
                now = time.monotonic()
                counts = self._counts()
                for process, count in counts.items():  # a count not there yet (None) is not a death either
                    if process not in last_moved or beats[process] != count:
                        beats[process], last_moved[process] = count, now
                    elif now - last_moved[process] > self._timeout_s:
                        self.fail(
                            f'process {process}: it has not answered for {now - last_moved[process]:.0f} s '
                            '(its host died or froze)',
                            own=False,
                            publish=True,
                        )
            except Exception as e:  # noqa: BLE001 - the coordination service itself is gone
                if self._closing.is_set():
                    return
                self.fail(
                    f"process 0: the job's coordination service stopped answering ({_first_line(e)}); "
                    'process 0 ended or its host died',
                    own=False,
                    publish=False,
                )
            if self._closing.wait(POLL_S):
                return

    def _counts(self) -> dict[int, str]:
        """The counts this process watches, of processes still running: every other process's on
        process 0, process 0's elsewhere."""
        done = self._done()
        if self._index == 0:
            return {p: count for p, count in self._alive().items() if p not in done | {0}}
        return {} if 0 in done else {0: self._try_get(f'{_ALIVE}0')}

    def _alive(self) -> dict[int, str]:
        """Every process's count (one request)."""
        return {int(key.rsplit('/', 1)[1]): value for key, value in self._client.key_value_dir_get(_ALIVE)}

    def _done(self) -> set[int]:
        """The processes that ended normally."""
        return {int(key.rsplit('/', 1)[1]) for key, _ in self._client.key_value_dir_get(_DONE)}

    def _try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as e:  # noqa: BLE001 - NOT_FOUND is how an absent key answers
            if 'NOT_FOUND' in str(e) or 'not found' in str(e).lower():
                return None
            raise

    def fail(self, line: str, own: bool, publish: bool = True, say: Callable[[], None] = lambda: None) -> None:
        """Publishes `line` unless a failure was published first; prints the first failure; runs the
        registered actions (unless `own`: the failed thread's own stack did); ends the process."""
        with self._lock:
            if self._failing:  # the main thread and the watcher, both: one ends the process
                threading.Event().wait()
            self._failing = True
        first = line
        try:
            if own and (silent := self._silent()):  # a collective failed because a peer is gone: that is the cause
                line = first = f'process {silent[0]}: it stopped answering (its host died or froze)'
            if publish:
                try:
                    self._client.key_value_set(_FAILED, line)
                except Exception:  # noqa: BLE001 - another process published first
                    first = self._try_get(_FAILED) or line
            self._client.key_value_set(f'{_SEEN}{self._index}', '1', allow_overwrite=True)
            if self._index == 0:  # the coordination service lives here: ending first would abort the others
                self._wait_for_the_others()
        except Exception:  # noqa: BLE001 - the service is gone: say what is known
            pass
        if not own:
            for action in list(self.actions):
                try:
                    action()
                except Exception as e:  # noqa: BLE001 - the process ends anyway; say what was left
                    logging.warning('while stopping: %s', _first_line(e))
        process, _, cause = first.partition(': ')
        if own and first == line and process == f'process {self._index}':
            say()
        else:
            print(f'error: {process} stopped: {cause}', file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def _silent(self) -> list[int]:
        """The other processes, not ended normally, whose counts do not move over SILENT_S (a live
        watcher counts every POLL_S from its start)."""
        before = self._alive()
        time.sleep(SILENT_S)
        after, done = self._alive(), self._done()
        return sorted(
            p for p in range(self._count) if p != self._index and p not in done and after.get(p) == before.get(p)
        )

    def _wait_for_the_others(self) -> None:
        """Until every other process has seen the failure (and ends at once), at most ACK_WAIT_S."""
        deadline = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < deadline and len(self._client.key_value_dir_get(_SEEN)) < self._count:
            time.sleep(0.05)
        time.sleep(EXIT_GRACE_S)

    def close(self) -> None:
        try:
            self._client.key_value_set(f'{_DONE}{self._index}', '1', allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service is already gone: nothing to tell
            pass
        self._closing.set()
        self._thread.join(timeout=2 * POLL_S)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f'{type(e).__name__}: {text.splitlines()[0] if text else ""}'.rstrip(': ')
