"""What only some commands need (requirements-extra.txt; libtpu: requirements-tpu.txt), checked before a
command does any work:
a comparison that would train for an hour and then fail to draw its figures stops at its first line.

    extras.require('vrl.experiments.compare (for its figures)', 'matplotlib')

Each check looks the packages up without importing them (importlib.util.find_spec).
"""

from __future__ import annotations

import importlib.util

from vrl.core.errors import VrlError

EXTRAS_FILE = 'requirements-extra.txt'


class MissingExtraError(VrlError, ImportError):
    """A package of requirements-extra.txt that the command needs is not installed."""


def missing(*packages: str) -> list[str]:
    """The importable names among `packages` that cannot be imported here."""
    absent = []
    for package in packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a parent package missing, or one hidden from this process
            found = False
        if not found:
            absent.append(package)
    return absent


def require(purpose: str, *packages: str, requirements: str = EXTRAS_FILE) -> None:
    """MissingExtraError naming `purpose`, what is missing and the install line (`requirements`: the
    file that brings it), if any of `packages` (importable names) is not installed."""
    if absent := missing(*packages):
        raise MissingExtraError(
            f'{purpose} needs {", ".join(absent)}, which is not installed: pip install -r {requirements} '
            '(nothing was run)'
        )
