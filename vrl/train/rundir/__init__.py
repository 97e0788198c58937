"""A run's directory and who owns it: one writer at a time (guard: a local flock, or on a bucket the
lease, whose record is also the fence), the run record (workdir) and the checkpoints. What the tools,
the experiments and the loop share about a workdir; imports vrl.core, vrl.model and vrl.train.config."""
