"""vLLM's OpenAI-compatible server on a checked export: `python -m vrl_vllm.serve --model DIR [flags]`
takes vLLM's server flags (`python -m vllm.entrypoints.openai.api_server --help`), checks DIR first
(vrl_vllm/check.py: one line and exit 2 where vLLM would fail a minute later), then starts the server."""

from __future__ import annotations

import runpy
import sys

from vrl_vllm.check import NotServable, check

SERVER = 'vllm.entrypoints.openai.api_server'


def model_argument(argv: list[str]) -> str | None:
    """The --model value (--model DIR or --model=DIR), or None."""
    for i, arg in enumerate(argv):
        if arg == '--model' and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith('--model='):
            return arg.split('=', 1)[1]
    return None


def main() -> None:
    model = model_argument(sys.argv[1:])
    if model is None:
        sys.exit('error: name the export to serve: python -m vrl_vllm.serve --model DIR [vLLM server flags]')
    try:
        check(model)
    except NotServable as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
    sys.argv[0] = SERVER
    runpy.run_module(SERVER, run_name='__main__', alter_sys=True)


if __name__ == '__main__':
    main()
