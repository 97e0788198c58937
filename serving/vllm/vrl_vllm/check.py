"""Is a directory one vLLM can serve? Checked in a second, before vLLM's engine spends a minute or more
starting and then fails inside a worker:

    python -m vrl_vllm.check DIR                       # one line: what is wrong and what to do, exit 2
    python -m vrl_vllm.serve --model DIR [vLLM's server flags]   # the check, then vLLM's OpenAI server

What it refuses: a path that is not a directory; a vrl training workdir (it says how to export it); a
config.json that is missing, not JSON or without a model_type; a VrlForCausalLM export whose
modeling_vrl.py is missing or older than the plugin; an export from a newer vrl that sets a field this
plugin does not serve (`unserved`); no *.safetensors; a weights file that is
cut short or whose header does not parse; a weights file whose SHA-256 differs from the one the export
recorded in SHA256SUMS.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from pathlib import Path

CHECKSUMS = 'SHA256SUMS'  # written by vrl.tools.export, in sha256sum's format


class NotServable(Exception):
    """Why vLLM cannot serve a directory, and what to do, in one line."""


# The fields of vrl's VrlConfig (the export's configuration_vrl.py) this plugin serves, as vrl.interop.hf.VRL_FIELDS
# names them (a test holds the two equal)
SERVED_FIELDS = frozenset(
    ('attention', 'lambda_mode', 'lambda1', 'lambda2', 'sparse_layers', 'neutreno', 'neutreno_lambda', 'denseformer')
    + ('kv_share', 'skip_v1', 'value_embed_layers', 'value_embed_tables', 'mudd', 'mudd_layers', 'hyper_connections')
    + ('hyper_streams', 'hyper_dynamic', 'attn_residuals', 'attn_residual_blocks', 'qk_norm')
)


def unserved(config: dict, configuration: Path) -> list[str]:
    """The fields the export's VrlConfig declares (`configuration`: its configuration_vrl.py), that this plugin
    does not serve, and that config.json sets (a newer vrl's variant)."""
    declared = set()
    for node in ast.walk(ast.parse(configuration.read_text() if configuration.is_file() else '')):
        if isinstance(node, ast.ClassDef) and node.name == 'VrlConfig':
            init = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == '__init__')
            declared = {arg.arg for arg in init.args.args + init.args.kwonlyargs}
    own = declared - {'self', 'tie_word_embeddings', 'initializer_range', 'use_cache'} - LLAMA_FIELDS
    return sorted(field for field in own - SERVED_FIELDS if config.get(field))


# Llama's and transformers' fields a VrlConfig declares too
LLAMA_FIELDS = frozenset(
    ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'head_dim')
    + ('num_key_value_heads', 'rms_norm_eps', 'rope_theta', 'max_position_embeddings', 'attn_logit_softcapping')
    + ('final_logit_softcapping', 'sliding_window', 'layer_types')
)


def check(path: str | Path) -> None:
    folder = Path(path)
    if not folder.is_dir():
        raise NotServable(f'{folder} is not a directory: serve the folder `python -m vrl.tools.export` wrote')
    config = folder / 'config.json'
    if not config.is_file():
        raise NotServable(f'{config} not found: serve the folder `python -m vrl.tools.export` wrote')
    try:
        record = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise NotServable(f'{config} is not JSON ({e}): export the model again') from None
    if 'model_type' not in record:
        if (folder / 'checkpoints').is_dir() or {'model', 'train'} <= record.keys():
            raise NotServable(
                f'{folder} is a vrl training workdir, not a Hugging Face export: make one with '
                f"`python -m vrl.tools.export --workdir={folder} --out={folder}-hf` (in vrl's environment) "
                'and serve that'
            )
        raise NotServable(f'{config} has no model_type: not a Hugging Face model directory')
    modeling = folder / 'modeling_vrl.py'
    if record['model_type'] == 'vrl' and (not modeling.is_file() or 'def layer_loop(' not in modeling.read_text()):
        raise NotServable(
            f'{modeling} is missing or older than this plugin (it has no layer_loop): export the model again'
        )
    newer = unserved(record, folder / 'configuration_vrl.py') if record['model_type'] == 'vrl' else []
    if newer:
        raise NotServable(
            f'{config} sets {", ".join(f"{field}={record[field]!r}" for field in newer)}, which this vrl_vllm does '
            'not serve: install the plugin of the vrl that exported it (bash serving/vllm/install)'
        )
    weights = sorted(folder.glob('*.safetensors'))
    if not weights:
        raise NotServable(f'no *.safetensors in {folder}: export the model again')
    recorded = _recorded_sums(folder / CHECKSUMS)
    for file in weights:
        _check_header(file)
        if file.name in recorded and _sha256(file) != recorded[file.name]:
            raise NotServable(
                f'{file} is damaged: its SHA-256 differs from the one in {folder / CHECKSUMS}; export the model again'
            )


def _recorded_sums(file: Path) -> dict[str, str]:
    """{file name: hex digest} from a sha256sum listing (none: nothing to compare)."""
    if not file.is_file():
        return {}
    return {
        name.lstrip('*'): digest for digest, name in (line.split(maxsplit=1) for line in file.read_text().splitlines())
    }


def _check_header(file: Path) -> None:
    """The safetensors header parses and every tensor's bytes lie inside the file."""
    size = file.stat().st_size
    with file.open('rb') as f:
        start = f.read(8)
        length = int.from_bytes(start, 'little') if len(start) == 8 else size
        if length > size - 8:
            raise NotServable(f'{file} is damaged: cut short ({size:,} bytes); export the model again')
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            raise NotServable(
                f"{file} is damaged: its header is not safetensors' JSON; export the model again"
            ) from None
    end = max((entry['data_offsets'][1] for name, entry in header.items() if name != '__metadata__'), default=0)
    if 8 + length + end > size:
        raise NotServable(
            f'{file} is damaged: cut short ({size:,} bytes of {8 + length + end:,}); export the model again'
        )


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open('rb') as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print('usage: python -m vrl_vllm.check DIR', file=sys.stderr)
        return 2
    try:
        check(argv[0])
    except NotServable as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(f'{argv[0]}: vLLM can serve it')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
