"""Training: the run's config, state and step, optimizers, the compile and auto-fit (aot), checkpoints, the
workdir and its guard, metrics and trackers, diagnostics, lm-eval scoring (scorer, lm_eval_*), the loop
(`python -m vrl.main` runs it), a finished run read back (trained). Imports vrl.core, model, data, interop."""
