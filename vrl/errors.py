"""The one base class of every error vrl reports to a user (vrl/cli.py prints it as one line)."""


class VrlError(Exception):
    """Bad input or a state vrl cannot go on from; the message says what is wrong, where vrl looked
    and what to do. Each module's error class derives from it (and from the builtin it resembles)."""
