"""Training: state and step, optimizers, the ahead-of-time compile and auto-fit (aot), checkpoints, the
workdir and its guard, metrics and trackers, diagnostics, lm-eval scoring (scorer, lm_eval_*), the loop
(`python -m vrl.main` runs it), a finished run read back (trained). Imports vrl.core, model, data, interop."""
