"""vrl/core/native_lines.py: the native libraries' empty lines are dropped, everything else arrives,
Python's streams keep their terminal, and a crash's last bytes are not lost."""

import re
import subprocess
import sys

from tests.conftest import ROOT

GLOO = b'[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n'
GLOO_SHORT = b'[Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3\n'
CREDENTIALS = (
    b'E1126 10:34:38.026219    8633 google_auth_provider.cc:188] Could not find the credentials file in '
    b'the standard gcloud location [/root/.config/gcloud/application_default_credentials.json]. You may '
    b'specify a credentials file using $GOOGLE_APPLICATION_CREDENTIALS, or to use Google application '
    b'default credentials, run: gcloud auth application-default login\n'
)
NO_CREDENTIALS = (
    b'E1126 10:34:39.000001    8633 google_auth_provider.cc:201] Could not locate the credentials '
    b'file and not running on GCE.\n'
)

INTERLEAVED = (
    b'[Gloo] Rank [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks '
    b'is : 3\n1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n'
)  # a pod's
INTERLEAVED_SHORT = (
    b'[Gloo] Rank 2[Gloo] Rank  is connected to 3 peer ranks. Expected number of connected peer '
    b'ranks is : 3\n3 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3\n'
)

RUN_TOGETHER = (
    b'[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3[Gloo] '
    b'Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n\n'
)  # a pod's: one message into the next, both newlines after
RUN_TOGETHER_SHORT = RUN_TOGETHER.replace(b'connected to 3', b'connected to 2', 1)

_PROGRAM = f"""
import os, signal, sys
from vrl.core import native_lines
native_lines.quiet()
print('vrl line', sys.stdout.isatty(), flush=True)
os.write(1, {GLOO!r} + b'native stdout\\n' + {GLOO_SHORT!r} + {INTERLEAVED!r})
os.write(1, {INTERLEAVED_SHORT!r} + b'7\\n' + {RUN_TOGETHER!r} + b'8\\n' + {RUN_TOGETHER_SHORT!r})
os.write(2, {CREDENTIALS!r} + {NO_CREDENTIALS!r})
print('vrl error line', file=sys.stderr, flush=True)
os.write(2, b'last native bytes, no newline')
os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing flushed, no atexit
"""


def test_native_noise_is_dropped_and_everything_else_arrives_even_after_a_crash():
    out = subprocess.run([sys.executable, '-c', _PROGRAM], cwd=ROOT, capture_output=True, timeout=60)
    assert out.returncode == -9  # killed
    assert sorted(out.stdout.splitlines(keepends=True)) == sorted(
        [
            b'vrl line False\n',
            b'native stdout\n',
            GLOO_SHORT,
            *INTERLEAVED_SHORT.splitlines(keepends=True),
            b'7\n',
            b'8\n',
            *RUN_TOGETHER_SHORT.splitlines(keepends=True),
        ]
    )
    assert sorted(out.stderr.splitlines(keepends=True)) == sorted(
        [NO_CREDENTIALS, b'vrl error line\n', b'last native bytes, no newline']
    )


def test_the_abort_of_a_process_whose_job_failed_is_one_line_naming_why_and_other_lines_pass():
    from vrl.core import native_lines

    notice = [
        b'W1127 11:07:49.861388   18101 preemption_sync_manager.cc:147] Failed to retrieve preemption notice',
        b':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}.',
    ]
    abort = [
        b'F1127 11:07:49.862350   18101 client.h:80] Terminating process because the JAX distributed service '
        b'detected fatal errors. This most likely indicates that another task died; absl::Status: UNAVAILABLE: '
        b'Failed to send RPC to coordination service. Either the leader task was preempted/died',
        b'*** Check failure stack trace: ***',
        b'    @     0x7f0f3ea40634  absl::LogMessage::SendToLog()',
        b'Fatal Python error: Aborted',
        b'Thread 0x00007f97e7dfe6c0 (most recent call first):',
    ]
    other = b'E1127 11:07:50.000000   18101 other.cc:1] something else'
    lost = native_lines.NOISE['stderr']()
    assert [kept for line in [*notice, other] for kept in lost.feed(line)] + lost.end() == [*notice, other]
    lost = native_lines.NOISE['stderr']()
    assert [kept for line in [*notice, *abort, other] for kept in lost.feed(line)] + lost.end() == [
        native_lines.JaxAbort.LEADER_LOST
    ]
    lost = native_lines.NOISE['stderr']()
    assert [kept for line in notice for kept in lost.feed(line)] + lost.end() == notice  # held lines reach the end
    never_joined = [
        b'F1127 11:51:04.251399   22189 client.h:80] Terminating process because the JAX distributed '
        b'service detected fatal errors. This most likely ... absl::Status: DEADLINE_EXCEEDED: Deadline '
        b'Exceeded',
        b'',
        b'RPC: /xla.coordination.CoordinationService/RegisterTask',
        *abort[1:],
    ]
    alone = native_lines.NOISE['stderr']()
    assert [kept for line in never_joined for kept in alone.feed(line)] + alone.end() == [
        native_lines.JaxAbort.NOT_JOINED
    ]
    given_up = [  # process 0 stopped waiting for the job, and its service went, while this process joined
        abort[0],
        b'Additional GRPC error information from remote target coordination_service while calling '
        b'/xla.coordination.CoordinationService/RegisterTask:',
        *abort[1:],
    ]
    alone = native_lines.NOISE['stderr']()
    assert [kept for line in given_up for kept in alone.feed(line)] + alone.end() == [native_lines.JaxAbort.NOT_JOINED]


_WARNS = """
from absl import logging
from vrl.core import cli

def main(args):
    logging.warning('clearing an unfinished build of %s', 'plays')
    logging.info('not shown')
    print('done')

cli.run(main, lambda: {})
"""


def test_a_commands_warning_is_a_plain_line_and_verbosity_brings_absls_format_back():
    """Without --verbosity a command's warning reads `warning: MESSAGE` (not absl's `W1201 04:25:26...
    file.py:312]` line) and INFO is off; --verbosity=0 shows absl's own lines."""
    plain = subprocess.run([sys.executable, '-c', _WARNS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and plain.stdout == 'done\n', plain.stderr
    assert plain.stderr == 'warning: clearing an unfinished build of plays\n'
    verbose = subprocess.run(
        [sys.executable, '-c', _WARNS, '--verbosity=0'], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert verbose.returncode == 0 and re.search(
        r'^W\d{4} [\d:.]+ +\d+ <string>:\d+\] clearing an unfinished build of plays$', verbose.stderr, re.M
    ), verbose.stderr
    assert 'not shown' in verbose.stderr
