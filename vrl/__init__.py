"""vrl: pretraining Llama-style decoders with value residual learning (vanilla, ResFormer, SVFormer).

The package is in wings, each importing only those before it in WINGS (tests/test_layout.py holds
every module to it); `vrl/main.py`, the training command, sits on top. docs/contributing.md says
what lives where.
"""

WINGS = ('core', 'model', 'data', 'interop', 'train', 'tools', 'experiments')

import sys  # noqa: E402

from vrl.core import backend, host_memory  # noqa: E402

host_memory.restart_command(sys.orig_argv)  # a training or decoding command: before anything is imported
backend.skip_absent_tpu()  # before anything imports jax
backend.choose_cpu_options()  # likewise: XLA reads XLA_FLAGS once, when its CPU client starts
