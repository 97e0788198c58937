"""Training: state and step, optimizers, the ahead-of-time compile and auto-fit (aot), checkpoints,
the workdir, metrics and trackers, diagnostics, the loop (`python -m vrl.main` runs it) and a
finished run read back (trained). Imports vrl.core, vrl.model, vrl.data and vrl.interop."""
