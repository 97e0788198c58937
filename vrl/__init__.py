"""vrl: pretraining Llama-style decoders with value residual learning (vanilla, ResFormer, SVFormer)."""

from vrl import backend

backend.skip_absent_tpu()  # before anything imports jax
