"""vrl/core/native_lines.py: the native libraries' empty lines are dropped, everything else arrives,
Python's streams keep their terminal, and a crash's last bytes are not lost."""

import subprocess
import sys

from tests.conftest import ROOT

GLOO = b'[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n'
GLOO_SHORT = b'[Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3\n'
CREDENTIALS = (b'E1126 10:34:38.026219    8633 google_auth_provider.cc:188] Could not find the credentials file in '
               b'the standard gcloud location [/root/.config/gcloud/application_default_credentials.json]. You may '
               b'specify a credentials file using $GOOGLE_APPLICATION_CREDENTIALS, or to use Google application '
               b'default credentials, run: gcloud auth application-default login\n')
NO_CREDENTIALS = (b'E1126 10:34:39.000001    8633 google_auth_provider.cc:201] Could not locate the credentials '
                  b'file and not running on GCE.\n')

INTERLEAVED = (b'[Gloo] Rank [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks '
               b'is : 3\n1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n')  # a pod's
INTERLEAVED_SHORT = (b'[Gloo] Rank 2[Gloo] Rank  is connected to 3 peer ranks. Expected number of connected peer '
                     b'ranks is : 3\n3 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3\n')

_PROGRAM = f'''
import os, signal, sys
from vrl.core import native_lines
native_lines.quiet()
print('vrl line', sys.stdout.isatty(), flush=True)
os.write(1, {GLOO!r} + b'native stdout\\n' + {GLOO_SHORT!r} + {INTERLEAVED!r})
os.write(1, {INTERLEAVED_SHORT!r} + b'7\\n')
os.write(2, {CREDENTIALS!r} + {NO_CREDENTIALS!r})
print('vrl error line', file=sys.stderr, flush=True)
os.write(2, b'last native bytes, no newline')
os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing flushed, no atexit
'''


def test_native_noise_is_dropped_and_everything_else_arrives_even_after_a_crash():
    out = subprocess.run([sys.executable, '-c', _PROGRAM], cwd=ROOT, capture_output=True, timeout=60)
    assert out.returncode == -9  # killed
    assert sorted(out.stdout.splitlines(keepends=True)) == sorted(
        [b'vrl line False\n', b'native stdout\n', GLOO_SHORT, *INTERLEAVED_SHORT.splitlines(keepends=True), b'7\n'])
    assert sorted(out.stderr.splitlines(keepends=True)) == sorted(
        [NO_CREDENTIALS, b'vrl error line\n', b'last native bytes, no newline'])
