"""The one base class of every error vrl reports to a user (vrl/core/cli.py prints it as one line)."""


class VrlError(Exception):
    """Bad input or a state vrl cannot go on from; the message says what is wrong, where vrl looked
    and what to do. Each module's error class derives from it (and from the builtin it resembles)."""


class CheckpointError(VrlError):
    """A checkpoint that cannot be used (a run's, or Hugging Face weights to start from); the
    message says which and why."""
