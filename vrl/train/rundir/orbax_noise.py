"""Orbax's failure noise, reduced to vrl's one line: a failed checkpoint read or write is reported
by vrl/train/rundir/checkpoint.py as one error; these filters drop the multi-line logs and the leftover
tracebacks of Orbax's asynchronous machinery that would follow it. Process-wide, installed once."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

_ORBAX = f'{os.sep}orbax{os.sep}'


def _is_orbax_error(error: BaseException) -> bool:
    """An error raised in Orbax's code, or by a tensorstore future that Orbax awaited (its only frame is
    asyncio's; tensorstore's errors carry the spec they were raised for): vrl uses tensorstore only
    through Orbax."""
    if "[tensorstore_spec='" in str(error):
        return True
    return any(_ORBAX in frame.filename for frame in traceback.extract_tb(error.__traceback__))


class _OrbaxFailureLogs(logging.Filter):
    """Drops the multi-line error logs of a failed Orbax read or write (Orbax's own, and asyncio's
    'Task exception was never retrieved' for its tasks): vrl reports each failure in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if _ORBAX in record.pathname:
            return False
        error = record.exc_info[1] if record.exc_info else None
        while error is not None:
            if _is_orbax_error(error):
                return False
            error = error.__cause__ or error.__context__
        return True


_FAILURE_LOGS = _OrbaxFailureLogs()


class _Reraised(logging.Filter):
    """Drops a traceback logged for an error that is raised on to its caller (fsspec's prefetcher does so
    for each failed read under Orbax), which reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info)


_RERAISED = _Reraised()


def _is_async_leftover(value: BaseException | None, obj: Any = None) -> bool:
    """What a failed Orbax read or write leaves behind: tensorstore callbacks into a closed event loop,
    and Orbax coroutines garbage-collected unfinished. Neither says more than the one-line error."""
    if isinstance(value, RuntimeError) and str(value) == 'Event loop is closed':
        return True
    code = getattr(obj, 'cr_code', None)
    return code is not None and _ORBAX in code.co_filename


def _quiet_async_leftovers() -> None:
    """Drops those leftovers' tracebacks (hundreds of lines per failure); everything else is printed."""
    if getattr(sys.excepthook, 'vrl_quiet', False):
        return
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def quiet_excepthook(kind, value, tb):
        if not _is_async_leftover(value):
            excepthook(kind, value, tb)

    def quiet_unraisablehook(unraisable):
        if not _is_async_leftover(unraisable.exc_value, unraisable.object):
            unraisablehook(unraisable)

    quiet_excepthook.vrl_quiet = True
    sys.excepthook, sys.unraisablehook = quiet_excepthook, quiet_unraisablehook


def quiet() -> None:
    """Installs the log filter on absl's and asyncio's loggers and the quiet hooks (idempotent)."""
    for logger in ('absl', 'asyncio'):
        logging.getLogger(logger).addFilter(_FAILURE_LOGS)  # a filter is added only if absent
    logging.getLogger('fsspec.prefetcher').addFilter(_RERAISED)
    _quiet_async_leftovers()
