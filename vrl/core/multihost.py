"""What the processes of a multi-host job (jax.distributed) do together: start (`initialize`, from the
flags every command of several processes takes), wait for each other, and let process 0 alone do
what must happen once — check and claim the workdir, build a dataset or train a tokenizer in a
shared data_dir — while the others learn its outcome. A one-process job runs each function
directly."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, TypeVar

import jax
import numpy as np
from absl import flags

from vrl.core import peers, roll_call
from vrl.core.errors import VrlError

T = TypeVar('T')
_MESSAGE_BYTES = 2048  # process 0's error line, as every process receives it


class PeerError(VrlError, RuntimeError):
    """Another process stopped on bad input; this one reports its line."""

    agreed = True  # every process stops on it together


def agreed(error: BaseException) -> bool:
    """Whether every process of the job stops on `error` together (`everywhere` raised it)."""
    return getattr(error, 'agreed', False)


class AloneError(RuntimeError):
    """A collective operation called from code that only process 0 runs (`on_process_0`): the other
    processes never call it, so it would wait for them forever, or pair with an unrelated one."""


_alone = threading.local()  # depth of on_process_0 calls this thread is inside


@contextlib.contextmanager
def _only_this_process() -> Iterator[None]:
    _alone.depth = getattr(_alone, 'depth', 0) + 1
    try:
        yield
    finally:
        _alone.depth -= 1


def together(operation: str) -> None:
    """Raises AloneError when `operation`, a collective, is called inside `on_process_0` (on any number
    of processes, so that a one-process test finds the mistake a pod would hang on)."""
    if getattr(_alone, 'depth', 0):
        raise AloneError(
            f'{operation} is a collective operation, called from code that only process 0 runs '
            '(multihost.on_process_0): the other processes would never join it. Run that code on '
            'every process (multihost.everywhere) instead.'
        )


def define_flags() -> dict[str, flags.FlagHolder]:
    """The flags that join a process to a job of several (Cloud TPU and SLURM need none)."""
    return {
        'coordinator_address': flags.DEFINE_string(
            'coordinator_address',
            None,
            'Multi-process: host:port of '
            'process 0 (GPU clusters, localhost tests). Cloud TPU and SLURM '
            'are auto-detected.',
        ),
        'num_processes': flags.DEFINE_integer('num_processes', None, 'Multi-process: how many processes.'),
        'process_id': flags.DEFINE_integer('process_id', None, "Multi-process: this process's index."),
        'peer_timeout_s': flags.DEFINE_integer(
            'peer_timeout_s',
            PEER_TIMEOUT_S,
            'Multi-process: a process that '
            'has not answered for this many seconds (its host died or froze) '
            'stops every process.',
        ),
        'join_timeout_s': flags.DEFINE_integer(
            'join_timeout_s',
            JOIN_TIMEOUT_S,
            'Multi-process: how long each process waits for all of them to join the job before it stops.',
        ),
    }


PEER_TIMEOUT_S = 60  # --peer_timeout_s
JOIN_TIMEOUT_S = 300  # --join_timeout_s: jax.distributed's initialization timeout
JAX_HEARTBEAT_MARGIN_S = 60  # jax.distributed's own dead-process check: later than vrl's, which says it in one line


def initialize(args: dict[str, flags.FlagHolder]) -> None:
    """jax.distributed for several processes: explicit flags, or a detected Cloud TPU pod / SLURM job;
    a roll call says who is missing while the job forms (vrl/core/roll_call.py); then every process
    watches the others (vrl/core/peers.py)."""
    timeout, join_timeout = args['peer_timeout_s'].value, args['join_timeout_s'].value
    joining = f'(waiting up to {join_timeout} s for every process: --join_timeout_s)'
    if args['coordinator_address'].value:
        job = (args['coordinator_address'].value, args['num_processes'].value, args['process_id'].value)
    elif ',' in os.environ.get('TPU_WORKER_HOSTNAMES', '') or int(os.environ.get('SLURM_NTASKS', '1')) > 1:
        from jax._src import clusters  # the detection jax.distributed.initialize runs, done here to know the job

        job = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, join_timeout)[:3]
    else:
        return
    coordinator, num_processes, process_id = job
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU processes talk over gloo
    print(f'process {process_id} of {num_processes}: joining the job at {coordinator} {joining}', flush=True)
    end_roll_call = roll_call.start(
        coordinator,
        num_processes,
        process_id,
        roll_call.report_every(join_timeout),
        lambda line: print(line, flush=True),
    )
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            initialization_timeout=join_timeout,
            heartbeat_timeout_seconds=timeout + JAX_HEARTBEAT_MARGIN_S,
        )
    finally:
        end_roll_call()
    from jax._src import distributed  # the client has no public accessor

    peers.watch(distributed.global_state.client, timeout)


def preemption_service() -> bool:
    """Whether JAX's preemption service runs (jax.distributed with several processes): it catches
    SIGTERM itself, and `multihost_utils.reached_preemption_sync_point` tells every process at
    which step to save."""
    from jax._src import distributed  # the service's state has no public accessor

    return jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None


def sync(name: str) -> None:
    """Every process waits here until all have arrived."""
    together(f'sync({name!r})')
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def every_process(flag: bool) -> bool:
    """Whether `flag` holds on every process: one small all-gather (none on one process)."""
    together('every_process')
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([flag]))))


def summed(values: np.ndarray) -> np.ndarray:
    """`values` summed over every process: one small all-gather (none on one process)."""
    together('summed')
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.sum(multihost_utils.process_allgather(values), axis=0)


def _gather_text(text: str) -> list[str]:
    """Every process's `text` (at most _MESSAGE_BYTES of UTF-8), in process order, on every process."""
    from jax.experimental import multihost_utils

    buffer = np.zeros(_MESSAGE_BYTES, np.uint8)
    encoded = text.encode()[:_MESSAGE_BYTES]
    buffer[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    received = np.asarray(multihost_utils.process_allgather(buffer)).reshape(jax.process_count(), _MESSAGE_BYTES)
    return [bytes(row).rstrip(b'\0').decode(errors='replace') for row in received]


def line_of(error: BaseException) -> str:
    """`error` in one line: a VrlError's message (written for the user), another's type and message."""
    text = ' '.join(str(error).split())
    return text if isinstance(error, VrlError) and text else f'{type(error).__name__}: {text}'


def everywhere(fn: Callable[[], T]) -> T:
    """fn() on every process. Whatever one raises stops every process: that one raises it, each
    other a PeerError with its line (a VrlError's message; another error's type and message), so
    none waits for a peer that left."""
    together('everywhere')
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - every kind must reach the other processes
        error = e
    lines = _gather_text('' if error is None else line_of(error))
    if error is not None:
        error.agreed = True  # every process stops on it together (cli.run: through the shutdown barrier)
        raise error
    for index, line in enumerate(lines):
        if line:
            raise PeerError(f'process {index} stopped: {line}')
    return result


def on_process_0(fn: Callable[[], T]) -> T | None:
    """fn() on process 0 (None elsewhere); what it raises stops every process (`everywhere`). fn may
    call no collective operation (AloneError): the other processes are not running it."""

    def alone() -> T | None:
        if jax.process_index() != 0:
            return None
        with _only_this_process():
            return fn()

    return everywhere(alone)


def process_0_first(fn: Callable[[], T]) -> T:
    """fn() on process 0, then on every other process once process 0's call has returned: what it
    made in a shared place (a dataset, a tokenizer) is there for the others to read."""
    result = on_process_0(fn)
    return result if jax.process_index() == 0 else fn()
