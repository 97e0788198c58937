"""Training: state and step, optimizers, the ahead-of-time compile and auto-fit (aot), checkpoints,
the workdir, metrics and trackers, diagnostics, lm-eval scoring (harness), the loop (`python -m
vrl.main` runs it) and a finished run read back (trained). Imports vrl.core, model, data, interop."""
