"""Export a trained workdir as a Hugging Face model directory:

    python -m vrl.export --workdir=DIR --out=HF_DIR

Writes what vrl/hf.py describes (config.json, model.safetensors, the tokenizer; for every variant
but vanilla, vrl's PyTorch modeling files); load it with
`transformers.AutoModelForCausalLM.from_pretrained(HF_DIR, trust_remote_code=True)` (a vanilla
model is a plain LlamaForCausalLM and needs no remote code) and `AutoTokenizer.from_pretrained(HF_DIR)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
from absl import app, flags, logging

from vrl import checkpoint
from vrl.train import load_trained
from vrl.workdir import WorkdirError


def _define_flags() -> dict[str, flags.FlagHolder]:
    return {
        'workdir': flags.DEFINE_string('workdir', None, 'A training workdir (config.json + checkpoints/).'),
        'out': flags.DEFINE_string('out', None, 'The Hugging Face directory to write.'),
    }


def main(argv: list[str], args: dict[str, flags.FlagHolder]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if not args['workdir'].value or not args['out'].value:
        raise app.UsageError('give --workdir and --out')
    logging.set_verbosity(logging.WARNING)
    try:
        from vrl import hf
    except ImportError as e:
        sys.exit(f'error: {e}')
    try:
        run = load_trained(args['workdir'].value)
        files = hf.export(jax.device_get(run.params), run.config.model, run.config.data.seq_len, run.tokenizer,
                          Path(args['out'].value))
    except (hf.HFError, FileNotFoundError, checkpoint.CheckpointError, WorkdirError) as e:
        sys.exit(f'error: {e}')
    print(f'{run.config.model.variant_name} at step {run.step} -> {args["out"].value}: '
          + ', '.join(f.name for f in files))


if __name__ == '__main__':
    _ARGS = _define_flags()
    app.run(lambda argv: main(argv, _ARGS))
