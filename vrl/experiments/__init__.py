"""Experiments over many runs: the grid they share, `python -m vrl.experiments.compare|study|analyze`,
their reports, curves, scaling fits and plots. The top wing: imports any other, none imports it."""
