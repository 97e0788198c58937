"""What every `python -m vrl.<command>` shares, in one place.

    if __name__ == '__main__':
        cli.run(main, _define_flags)            # main(args)
        cli.run(main, _define_flags, ('prepare', 'stats'))  # main(args, command)

Flags are defined only when the command runs (other modules and the notebook import its
functions); a bad `--config` file or override is one line naming it; library INFO logging (absl,
TFDS) and the native libraries' lines that say nothing (vrl/core/native_lines.py) are off unless
`--verbosity` is given, and warnings read `warning: <message>`; a `VrlError` ends the command with
one line, `error: <message>`, and exit status 1; `--help` lists the command's own flags, exit 0.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging as pylogging
import os
import re
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Callable

from absl import app, flags, logging

from vrl.core import config as config_lib
from vrl.core import multihost, native_lines, peers
from vrl.core.errors import VrlError

Args = dict[str, flags.FlagHolder]


def run(
    main: Callable[..., None],
    define_flags: Callable[[], Args],
    commands: tuple[str, ...] = (),
    schema: type | None = None,
) -> None:
    """Runs `main(args)`, or `main(args, command)` when the command takes one of `commands` first;
    `schema`: the config dataclass (vrl.train.config.Config) of a command that takes `--config`, whose
    sections and fields a bad override is told."""
    args = define_flags()
    sys.stdout.reconfigure(line_buffering=True)  # a pipe or a log keeps the lines in the order printed

    def entry(argv: list[str]) -> None:
        positional = argv[1:]
        if commands and (len(positional) != 1 or positional[0] not in commands):
            raise app.UsageError(f'usage: {_command()} {"|".join(commands)} [--flags]; --helpfull lists them')
        if not commands and positional:
            raise app.UsageError(f'unexpected arguments: {positional}')
        if not flags.FLAGS['verbosity'].present:
            logging.set_verbosity(logging.WARNING)
            logging.get_absl_handler().setFormatter(_PlainFormatter())
            native_lines.quiet()
        try:
            main(args, *positional)
        except Exception as e:
            if peers.watching() and not multihost.agreed(e):  # this process alone: the others stop too
                said = f'error: {e}' if isinstance(e, VrlError) else traceback.format_exc().rstrip()
                peers.stop(multihost.line_of(e), say=functools.partial(print, said, file=sys.stderr))  # ends it
            if isinstance(e, VrlError):
                sys.exit(f'error: {e}')
            raise

    app.run(entry, flags_parser=functools.partial(_parse_flags, functools.partial(_help, main, args), schema))


class _PlainFormatter(pylogging.Formatter):
    """A log record as a user reads the command's other lines: `warning: MESSAGE`, without absl's
    `W1201 04:25:26.123 123 file.py:312]` prefix (--verbosity brings that back)."""

    def format(self, record: pylogging.LogRecord) -> str:
        return f'{record.levelname.lower()}: {record.getMessage()}'


def compilation_cache_dir() -> str:
    """Where compiled programs are kept: JAX_COMPILATION_CACHE_DIR, else ~/.cache/vrl/jax_cache."""
    return os.environ.get('JAX_COMPILATION_CACHE_DIR') or str(Path.home() / '.cache' / 'vrl' / 'jax_cache')


def enable_compilation_cache() -> None:
    """Compiled steps are reused across runs and invocations (a grid's seeds share one compile), in
    `compilation_cache_dir()`."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update('jax_compilation_cache_dir', compilation_cache_dir())


def require(args: Args, *names: str) -> None:
    """app.UsageError naming the flags in `names` that were not given."""
    missing = [f'--{name}' for name in names if not args[name].value]
    if missing:
        raise app.UsageError(f'{" and ".join(missing)} {"is" if len(missing) == 1 else "are"} required')


HELP_FLAGS = ('--help', '-help', '--helpshort', '-h', '-?')


def _help(main: Callable[..., None], args: Args, full: bool) -> str:
    """The command's usage: its module's docstring, then its own flags (`full`: every flag absl holds)."""
    doc = (sys.modules[main.__module__].__doc__ or '').strip()
    if full:
        return f'{doc}\n\n{flags.FLAGS.get_help()}'
    lines = []
    for name in sorted(args):
        flag = flags.FLAGS[args[name].name]
        shown = f'--[no]{flag.name}' if flag.boolean else f'--{flag.name}'
        default = '' if flag.default is None else f' (default: {flag.default_as_str})'
        lines.append(textwrap.fill(f'{shown}: {flag.help}{default}', 100, subsequent_indent='    '))
    return (
        f'{doc}\n\nflags of {_command()}:\n'
        + textwrap.indent('\n'.join(lines), '  ')
        + ('\n\n--helpfull lists every flag (absl, JAX and the libraries too).')
    )


def _parse_flags(usage: Callable[[bool], str], schema: type | None, argv: list[str]) -> list[str]:
    """absl's parser, with config errors (unknown key, missing or broken file) as one clear line;
    --help (or -h, --helpshort) prints `usage(False)` and --helpfull `usage(True)`, each with exit 0."""
    given = argv[1 : argv.index('--')] if '--' in argv else argv[1:]
    if '--helpfull' in given or any(arg in HELP_FLAGS for arg in given):
        print(usage('--helpfull' in given))
        sys.exit(0)
    try:
        return flags.FLAGS([_preset(arg) for arg in argv])
    except flags.Error as e:
        text = str(e)
        if 'Traceback' in text:  # a config file raised: its exception's last line says why
            text = text.strip().splitlines()[-1].split(': ', 1)[-1]
        sys.exit(f'error: {" ".join(text.split())}\nPass --help for usage.')
    except SyntaxError as e:
        sys.exit(f'error: the config file {e.filename} does not parse: {e.msg} (line {e.lineno})')
    except KeyError as e:  # --config.SECTION.x=... with an unknown SECTION
        if schema is None:
            raise
        text = str(e.args[0]) if e.args else '?'
        key = re.split(r"['\\\n]", text.strip("'"), maxsplit=1)[0]
        given = next((a.split('=')[0] for a in argv if a.startswith(f'--config.{key}.')), f'--config.{key}')
        sections = [f.name for f in dataclasses.fields(schema)]
        sys.exit(f'error: {given}: ' + config_lib.not_a_field(key, sections, 'section'))
    except (AttributeError, TypeError, ValueError, OSError) as e:  # raised by --config.x=...
        unknown = _unknown_field(e, argv, schema) if isinstance(e, AttributeError) and schema else None
        if unknown:
            sys.exit(f'error: {unknown}')
        message = ' '.join(str(e.args[0] if e.args else e).replace("\\'", "'").replace('\\n', ' ').split())
        sys.exit(f'error: bad --config or override: {message.strip(chr(39))}'.replace("' Did you", ': Did you'))


def _preset(arg: str) -> str:
    """`--config=configs/X.py[:arg]` naming no file here: the preset installed with vrl (pyproject.toml
    installs configs/ as the `configs` package), so the presets work outside a checkout too."""
    if not arg.startswith('--config=configs/'):
        return arg
    given, colon, argument = arg.removeprefix('--config=').partition(':')
    if os.path.exists(given) or not (spec := importlib.util.find_spec('configs')) or not spec.origin:
        return arg
    installed = Path(spec.origin).parent / given.removeprefix('configs/')
    return f'--config={installed}{colon}{argument}' if installed.exists() else arg


def _unknown_field(e: AttributeError, argv: list[str], schema: type) -> str | None:
    """`--config.SECTION.FIELD=...` naming no field of SECTION: which override, and the section's fields."""
    inner = e.args[0] if e.args else ''
    text = str(inner.args[0] if isinstance(inner, KeyError) and inner.args else inner).strip('"\'')
    key = re.split(r'[:\'"\s]', text, maxsplit=1)[0]
    for arg in argv:
        parts = arg.split('=', 1)[0].removeprefix('--config.').split('.')
        if arg.startswith('--config.') and len(parts) == 2 and parts[1] == key:
            section = getattr(schema(), parts[0], None)
            if dataclasses.is_dataclass(section):
                known = [f.name for f in dataclasses.fields(section)]
                return f'{arg.split("=", 1)[0]}: ' + config_lib.not_a_field(f'{parts[0]}.{key}', known)
    return None


def _command() -> str:
    """How this command was called: `python -m vrl.data`, or `vrl-data` (pyproject.toml's scripts)."""
    spec = getattr(sys.modules['__main__'], '__spec__', None)
    return f'python -m {spec.name.removesuffix(".__main__")}' if spec else os.path.basename(sys.argv[0])
