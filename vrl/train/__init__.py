"""Training: the run's config, state and step, optimizers, the compile and auto-fit (aot), the workdir's
ownership and checkpoints (rundir/), metrics and trackers, diagnostics, scoring (scoring/), the loop
(`python -m vrl.main`), a finished run read back (trained). Imports vrl.core, model, data, interop."""
