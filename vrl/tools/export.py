"""Export a trained workdir as a Hugging Face model directory:

    python -m vrl.tools.export --workdir=DIR --out=HF_DIR

Writes what vrl/interop/hf.py describes (config.json, model.safetensors, the tokenizer; for every variant
but vanilla, vrl's PyTorch modeling files) and vrl_export.json (the run and step it came from).
The directory is written beside --out and then put in its place, so an interrupted export leaves
no half directory. An --out that holds anything but an earlier export of the same run is refused,
naming what it holds, unless --overwrite (which replaces it whole). Load it with
`transformers.AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)` (a vanilla
model is a plain LlamaForCausalLM and needs no remote code) and `AutoTokenizer.from_pretrained(HF_DIR)`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import jax
from absl import flags
from etils import epath

from vrl.core import cli, storage
from vrl.core.errors import VrlError
from vrl.train.trained import load_trained

MARKER = 'vrl_export.json'


class ExportError(VrlError, RuntimeError):
    """--out cannot be written as asked; the message says why and what to do."""


def publish(out: epath.Path, source: dict, overwrite: bool, write: Callable[[Path], object]) -> list[str]:
    """Writes a directory with `write(folder)` and `source` in folder/MARKER, then puts it at `out`
    (local or on an object store); returns the names of the files there.

    `out` may be missing, empty, an earlier export of the same workdir (source['workdir']), or, with
    `overwrite`, anything; otherwise ExportError names what it holds and nothing is touched. A local
    `out` is written beside and renamed into place; on an object store, which has no rename, the files
    are uploaded with MARKER last, so that an export without MARKER is known to be incomplete."""
    if out.exists() and not out.is_dir():
        raise ExportError(f'--out={out} is a file; give a directory.')
    held = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if held and not overwrite:
        try:
            earlier = json.loads((out / MARKER).read_text()).get('workdir')
        except (OSError, ValueError):
            earlier = None
        if earlier != source['workdir']:
            what = (
                f'an export of {earlier}'
                if earlier
                else 'other files: ' + ', '.join(held[:5]) + (', ...' if len(held) > 5 else '')
            )
            raise ExportError(
                f'--out={out} holds {what}; choose an empty or new directory, or pass --overwrite to '
                'replace it (nothing was written).'
            )
    local = not storage.is_remote(out)
    if local:
        out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f'.{out.name}.', dir=out.parent if local else None))
    try:
        write(staging)
        (staging / MARKER).write_text(json.dumps(source, indent=2))
        _permissions_as_umask(staging)
        if not local:
            if held:
                storage.delete(out / MARKER)  # the old export is incomplete from here on
                out.rmtree()
            storage.copy_tree(epath.Path(staging), out, last=(MARKER,))
        elif out.exists():
            previous = Path(out).rename(Path(out).with_name(staging.name + '.previous'))
            staging.rename(out)
            shutil.rmtree(previous)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return sorted(p.name for p in out.iterdir())


def _permissions_as_umask(folder: Path) -> None:
    """The modes a plain `mkdir` and `open` give under the process's umask, for `folder` and its files
    (mkdtemp makes 0700, safetensors writes 0600): others on a shared machine, or a serving container
    under another user, can read an export wherever they can read a file this user writes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob('*'):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _define_flags() -> dict[str, flags.FlagHolder]:
    return {
        'workdir': flags.DEFINE_string('workdir', None, 'A training workdir (config.json + checkpoints/).'),
        'out': flags.DEFINE_string('out', None, 'The Hugging Face directory to write.'),
        'overwrite': flags.DEFINE_bool('overwrite', False, 'Replace --out whatever it holds.'),
    }


def main(args: cli.Args) -> None:
    cli.require(args, 'workdir', 'out')
    try:
        from vrl.interop import hf
    except ImportError as e:
        sys.exit(f'error: {e}')
    run = load_trained(args['workdir'].value)
    params = jax.device_get(run.params)
    source = {
        'workdir': str(storage.path(args['workdir'].value)),
        'step': run.step,
        'variant': run.config.model.variant_name,
    }
    out = storage.path(args['out'].value)
    storage.check_writable(out.parent, '--out')
    try:
        files = publish(
            out,
            source,
            args['overwrite'].value,
            lambda folder: hf.export(params, run.config.model, run.config.data.seq_len, run.tokenizer, folder),
        )
    except Exception as e:  # noqa: BLE001 - safetensors reports a full disk as its own error, not an OSError
        if getattr(e, 'errno', None) != errno.ENOSPC and 'No space left on device' not in str(e):
            raise
        sys.exit(
            f'error: no space left on device writing the export to {out.parent}; nothing of it was kept and '
            f"{out} is as it was: free space (the export needs about its weights' size) and run the same command."
        )
    print(f'{run.config.model.variant_name} at step {run.step} -> {args["out"].value}: ' + ', '.join(files))


def cli_main() -> None:
    """`vrl-export` (pyproject.toml's scripts): `python -m vrl.tools.export` by another name."""
    cli.run(main, _define_flags)


if __name__ == '__main__':
    cli_main()
