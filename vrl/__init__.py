"""vrl: pretraining Llama-style decoders with value residual learning (vanilla, ResFormer, SVFormer).

The package is in wings, each importing only those before it in WINGS (tests/test_layout.py holds
every module to it); `vrl/main.py`, the training command, sits on top. docs/contributing.md says
what lives where.
"""

WINGS = ('core', 'model', 'data', 'interop', 'train', 'tools', 'experiments')

from vrl.core import backend  # noqa: E402

backend.skip_absent_tpu()  # before anything imports jax
