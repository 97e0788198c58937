"""One process's failure stops every process of a job within seconds, in one line that names it
(vrl/core/peers.py): an error raised on process 1 alone, a process killed outright, a process frozen.
Real jax.distributed processes on 127.0.0.1; the faults are real (an exception, SIGKILL, SIGSTOP)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.gcs_emulator import bucket_fs, free_port, machine_env
from tests.runs import ROOT, cli_args, host_xla_flags, tiny_config

pytestmark = pytest.mark.slow  # real processes: outside the edit loop's tier

# A command of two processes (vrl.core.cli, as every vrl command runs) whose process 0 waits in
# all-gathers while process 1, after it has joined three, raises or just sleeps (to be killed or
# frozen by the test); it prints when process 1 is past its last collective.
TWO_PROCESSES = """
import os, sys, time
import numpy as np
from vrl.core import cli, multihost

def main(args):
    multihost.initialize(args)
    import jax
    from jax.experimental import multihost_utils
    for i in range(1_000):
        if jax.process_index() == 0 or i < 3:
            multihost_utils.process_allgather(np.array([i]))
        elif i == 3:
            print(f'past the collectives at {time.time()}', flush=True)
            if os.environ['FAULT'] == 'raise':
                raise RuntimeError('the data of process 1 broke')
        time.sleep(0.2)

cli.run(main, multihost.define_flags)
"""


def _two_processes(fault: str, peer_timeout_s: int = 10) -> list[subprocess.Popen]:
    port = free_port()
    env = dict(os.environ, FAULT=fault, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu', XLA_FLAGS=host_xla_flags(1))
    return [
        subprocess.Popen(
            [
                sys.executable,
                '-c',
                TWO_PROCESSES,
                f'--coordinator_address=127.0.0.1:{port}',
                '--num_processes=2',
                f'--process_id={i}',
                f'--peer_timeout_s={peer_timeout_s}',
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _past_the_collectives(process: subprocess.Popen) -> float:
    for line in process.stdout:
        if line.startswith('past the collectives at '):
            return float(line.split()[-1])
    raise AssertionError(f'process 1 ended first: {process.wait()}')


def _said(output: str) -> list[str]:
    """The lines a user reads after the process joined its job: vrl's, not gloo's connection lines
    (filtered by vrl/core/native_lines.py)."""
    return [
        line
        for line in output.splitlines()
        if line and not line.startswith('[Gloo]') and not re.match(r'process \d of \d: joining the job at ', line)
    ]


def test_an_error_on_process_1_stops_process_0_at_once_in_one_line():
    zero, one = _two_processes('raise')
    raised = _past_the_collectives(one)
    said_zero = zero.communicate(timeout=120)[0]
    ended = time.time()
    said_one = one.communicate(timeout=60)[0]
    assert (zero.returncode, one.returncode) == (1, 1), (said_zero, said_one)
    assert _said(said_zero) == ['error: process 1 stopped: RuntimeError: the data of process 1 broke'], said_zero
    assert ended - raised < 30
    assert 'RuntimeError: the data of process 1 broke' in said_one and 'Check failure' not in said_one


@pytest.mark.parametrize(
    'fault, why', [(signal.SIGKILL, 'it stopped answering'), (signal.SIGSTOP, 'it has not answered for')]
)
def test_a_process_killed_or_frozen_stops_the_others_within_the_peer_timeout(fault, why):
    """Killed, its connections close and process 0's collective fails: the silent peer, not that
    failure, is named. Frozen, its connections stay open and process 0 waits in a collective that
    never completes: its watcher names the peer whose count stopped, after --peer_timeout_s."""
    zero, one = _two_processes('sleep', peer_timeout_s=10)
    _past_the_collectives(one)
    os.kill(one.pid, fault)
    signalled = time.time()
    try:
        said = zero.communicate(timeout=120)[0]
        ended = time.time()
    finally:
        one.kill()
        one.wait()
    assert zero.returncode == 1 and len(_said(said)) == 1, said
    assert _said(said)[0].startswith(f'error: process 1 stopped: {why}') and '(its host died or froze)' in said, said
    assert ended - signalled < 10 + 15


def test_process_0_killed_stops_the_others_at_once_in_one_line():
    """Process 0 hosts the coordination service: killed, JAX's client on process 1 aborts at once; what
    it prints is one line naming process 0, not gRPC errors, a C++ stack and a thread dump."""
    zero, one = _two_processes('sleep')
    _past_the_collectives(one)
    zero.kill()
    zero.wait()
    killed = time.time()
    said = one.communicate(timeout=60)[0]
    assert one.returncode != 0 and time.time() - killed < 10, said
    assert _said(said) == [
        'error: process 0 stopped answering: the coordination service it hosts is gone (its host died or froze)'
    ], said


def _forming(num_processes: int, started: list[int], how: str) -> list[subprocess.CompletedProcess]:
    """The processes `started` of a job of `num_processes` (the others never come), each waiting 5 s to join;
    the job given by flags (`how='flags'`) or, as SLURM's srun gives it, by environment variables."""
    port = free_port()
    env = dict(os.environ, FAULT='sleep', PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu', XLA_FLAGS=host_xla_flags(1))
    if how == 'slurm':  # jax's SLURM detection: the first node's port 61440 + job id % 4096
        job_id = next(job for job in range(4096) if _free(61440 + job) and _free(61441 + job))
        env.update(SLURM_JOB_ID=str(job_id), SLURM_STEP_NODELIST='localhost', SLURM_NTASKS=str(num_processes))
    processes = []
    for i in started:
        if how == 'slurm':
            args, env = [], dict(env, SLURM_PROCID=str(i), SLURM_LOCALID='0')
        else:
            args = [f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={num_processes}', f'--process_id={i}']
        processes.append(
            subprocess.Popen(
                [sys.executable, '-c', TWO_PROCESSES, *args, '--join_timeout_s=5'],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return [subprocess.CompletedProcess(p.args, p.returncode, *p.communicate(timeout=120)) for p in processes]


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(('127.0.0.1', port)) != 0


NOT_JOINED = (
    'error: not every process joined the job within --join_timeout_s: start each of them with the same '
    '--coordinator_address and --num_processes, and its own --process_id'
)


@pytest.mark.parametrize('how', ['flags', 'slurm'])
def test_a_job_that_never_forms_says_who_is_missing_then_stops_in_one_line(how):
    """Processes 0 and 2 of 3 started: each says it is joining and for how long it waits; while they
    wait, process 0 names process 1 as missing (every quarter of the join timeout), then both stop
    in one line."""
    started = time.time()
    zero, two = _forming(3, [0, 2], how)
    assert zero.returncode != 0 and two.returncode != 0 and time.time() - started < 60
    joining = (
        r'process {} of 3: joining the job at (?:127\.0\.0\.1|localhost):\d+ \(waiting up to 5 s for every process: '
        r'--join_timeout_s\)\n'
    )
    waiting = r'process 0 of 3: still waiting for process 1 to join \(here: 0, 2\)\n'
    assert re.fullmatch(joining.format(0) + f'(?:{waiting}){{2,}}', zero.stdout), zero.stdout
    assert re.fullmatch(joining.format(2), two.stdout), two.stdout
    assert _said(zero.stderr) == [NOT_JOINED] and _said(two.stderr) == [NOT_JOINED], (zero.stderr, two.stderr)


def test_a_process_whose_process_0_never_comes_says_so_while_it_waits():
    """Process 1 of 2 started alone: it says, every quarter of the join timeout, that process 0 has not
    answered at the roll call's address, then stops in one line."""
    (one,) = _forming(2, [1], 'flags')
    assert one.returncode != 0
    port = int(one.args[3].rsplit(':', 1)[1]) + 1
    lines = one.stdout.splitlines()
    assert len(lines) >= 3 and re.fullmatch(r'process 1 of 2: joining the job at .*', lines[0]), one.stdout
    for line in lines[1:]:
        assert re.fullmatch(
            rf'process 1 of 2: process 0 has not answered at 127\.0\.0\.1:{port} for \d+ s: is it '
            r'started, at that address\?',
            line,
        ), one.stdout
    assert _said(one.stderr) == [NOT_JOINED], one.stderr


def test_a_run_whose_process_1_fails_stops_in_seconds_and_releases_its_lease(gcs, small_corpus, tmp_path):
    """`python -m vrl.main` on two processes with a workdir on the bucket: process 1's data path
    raises after some steps while process 0 trains on (waiting in the step's collectives); process 0
    prints the cause in one line and exits within seconds, and the lease is released."""
    config = tiny_config(
        small_corpus, attention='svformer', steps=200, checkpoint_every=100, log_every=1, lease_stale_seconds=60
    )
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, eval_every=1_000))
    launcher = tmp_path / 'failing_data.py'
    launcher.write_text(
        'import runpy, sys, time\n'
        'from vrl.data import pipeline\n'
        'taken = [0]\n'
        'real = pipeline.next_batch\n'
        'def next_batch(iterator, *args):\n'
        '    taken[0] += 1\n'
        '    if taken[0] == 6 and "--process_id=1" in sys.argv:\n'
        '        print(f"raising at {time.time()}", flush=True)\n'
        '        raise RuntimeError("a shard of process 1 is unreadable")\n'
        '    return real(iterator, *args)\n'
        'pipeline.next_batch = next_batch\n'
        'runpy.run_module("vrl.main", run_name="__main__", alter_sys=True)\n'
    )
    port = free_port()
    args = cli_args(config, 'gs://vrl/peers_run')
    pod = [
        subprocess.Popen(
            [
                sys.executable,
                str(launcher),
                *args[3:],
                f'--coordinator_address=127.0.0.1:{port}',
                '--num_processes=2',
                f'--process_id={i}',
            ],
            cwd=tmp_path,
            env={**machine_env(gcs, tmp_path / f'host{i}'), 'XLA_FLAGS': host_xla_flags(2), 'JAX_PLATFORMS': 'cpu'},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    said_zero = pod[0].communicate(timeout=600)[0]
    ended = time.time()
    said_one = pod[1].communicate(timeout=60)[0]
    assert (pod[0].returncode, pod[1].returncode) == (1, 1), (said_zero[-3000:], said_one[-3000:])
    raised = float(next(line for line in said_one.splitlines() if line.startswith('raising at ')).split()[-1])
    assert ended - raised < 30, (ended - raised, said_zero[-2000:])
    errors = [line for line in said_zero.splitlines() if line.startswith('error')]
    assert errors == ['error: process 1 stopped: RuntimeError: a shard of process 1 is unreadable'], said_zero[-3000:]
    assert 'Traceback' not in said_zero and 'Check failure' not in said_zero + said_one
    lease = json.loads(bucket_fs().cat('vrl/peers_run/.lock'))
    assert lease.get('released') is True, lease


def test_the_roll_call_listens_at_the_coordinators_address_only():
    """Process 0's roll call takes the coordinator's host: reachable there (127.0.0.1), not at another
    address of the same machine (127.0.0.2, also loopback), where a listener on every interface would be."""
    from vrl.core import roll_call

    with socket.socket() as probe:  # a free port pair: P for the coordinator, P + 1 for the roll call
        probe.bind(('127.0.0.1', 0))
        port = probe.getsockname()[1]
    said: list[str] = []
    end = roll_call.start(f'127.0.0.1:{port}', 2, 0, 60.0, said.append)
    try:
        for _ in range(50):  # the listener's thread is up within a moment
            try:
                socket.create_connection(('127.0.0.1', port + 1), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError(f'no roll call at 127.0.0.1:{port + 1}: {said}')
        with pytest.raises(OSError):
            socket.create_connection(('127.0.0.2', port + 1), timeout=1).close()
    finally:
        end()
