"""The vLLM plugin's check of an export (serving/vllm/vrl_vllm/check.py: standard library only, so it runs in
vrl's environment too): which vrl fields the plugin serves, and an export from a newer vrl refused in one line
before vLLM starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from vrl.interop import hf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'serving' / 'vllm'))
from vrl_vllm import check  # noqa: E402


def test_the_plugin_serves_every_field_vrl_exports():
    """A field vrl's export adds must be served by the plugin (or this fails): the plugin's list is vrl's, and
    with every field of the export's VrlConfig set, nothing is unserved."""
    assert check.SERVED_FIELDS == set(hf.VRL_FIELDS)
    every_field_set = {field: 1 for field in (*hf.VRL_FIELDS, *check.LLAMA_FIELDS)}
    assert check.unserved(every_field_set, hf.MODELING_DIR / 'configuration_vrl.py') == []


def test_an_export_of_a_newer_vrl_is_one_line_before_vllm_starts(tmp_path):
    """An export whose VrlConfig declares a field this plugin does not serve, set in its config.json: one
    `error:` line naming the field and the fix, exit 2; the same field at its default (0) passes."""
    for name in ('configuration_vrl.py', 'modeling_vrl.py'):
        shutil.copyfile(hf.MODELING_DIR / name, tmp_path / name)
    configuration = (tmp_path / 'configuration_vrl.py').read_text()
    (tmp_path / 'configuration_vrl.py').write_text(
        configuration.replace('        skip_v1: int = 0,\n', '        skip_v1: int = 0,\n        skip_v2: int = 0,\n')
    )
    (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'vrl', 'skip_v1': 1, 'skip_v2': 2}))
    env = {**os.environ, 'PYTHONPATH': str(ROOT / 'serving' / 'vllm')}
    out = subprocess.run(
        [sys.executable, '-m', 'vrl_vllm.check', str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.count('\n') == 1, out.stderr
    assert out.stderr.startswith(f'error: {tmp_path / "config.json"} sets skip_v2=2, which this vrl_vllm does not')
    assert 'install the plugin of the vrl that exported it' in out.stderr
    (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'vrl', 'skip_v1': 1, 'skip_v2': 0}))
    with_default = subprocess.run(
        [sys.executable, '-m', 'vrl_vllm.check', str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert 'no *.safetensors' in with_default.stderr  # past the fields, to the weights
