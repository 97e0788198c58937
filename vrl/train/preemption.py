"""Preemption: SIGTERM (a Cloud TPU's notice) or a first Ctrl-C asks the run to save and stop after
a step; the processes of a job agree on that step and on the hooks' flags (`agree`)."""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np

from vrl.core import multihost


class Preemption:
    """SIGTERM (what Cloud TPU sends before preemption) and a first Ctrl-C: the run stops after a step,
    saved. With several processes, JAX's preemption service catches SIGTERM on any host and agrees,
    through the coordination service, on the step at which every host saves: checked at every step
    (a local read). A Ctrl-C, and the hooks' flags (a lost lease, a timed save due), are agreed
    every `every` steps (an all-gather)."""

    def __init__(self):
        self.requested = False
        self._telling: threading.Thread | None = None  # the thread that says a signal's line
        self._service = multihost.preemption_service()
        self._previous = {
            sig: signal.signal(sig, self._handle)
            for sig in ((signal.SIGINT,) if self._service else (signal.SIGTERM, signal.SIGINT))
        }

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # the second Ctrl-C aborts
        name = 'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'
        line = (
            f'{name}: the run saves a checkpoint at the next step that checks for it (within train.log_every '
            'steps; the steps already sent to the device finish first), then exits'
            + ('; Ctrl-C again aborts without saving' if signum == signal.SIGINT else '')
        )
        # said from another thread: the signal may have stopped this one inside a print, and printing
        # here would re-enter its stream; the other thread waits for the stream to be free
        self._telling = threading.Thread(target=print, args=(line,), kwargs={'flush': True}, daemon=True)
        self._telling.start()
        self.requested = True

    def agree(self, step: int, every: int, **local: bool) -> tuple[bool, dict[str, bool]]:
        """(preempted, each of `local`'s flags: whether it holds on any process), the same on every
        process; with several, the flags are gathered every `every` steps and False between. A
        signal's line is out before it returns."""
        if self._telling is not None:
            self._telling.join()
        if jax.process_count() == 1:
            return self.requested, local
        from jax.experimental import multihost_utils

        noticed = self._service and multihost_utils.reached_preemption_sync_point(step)
        if noticed:
            print(
                f'a preemption notice (SIGTERM) reached this pod: every host saves step {step}, then exits', flush=True
            )
        if step % every:
            return noticed, dict.fromkeys(local, False)
        agreed = multihost.summed(np.array([self.requested, *local.values()], np.int32)) > 0
        return noticed or bool(agreed[0]), {name: bool(flag) for name, flag in zip(local, agreed[1:])}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
