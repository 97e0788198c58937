"""notebooks/vrl_quickstart.ipynb runs top to bottom (a CPU-sized budget), showing its plots and a sample."""

import os

import pytest

pytest.importorskip('nbclient', reason='nbclient is in requirements-extra.txt: pip install -r requirements-extra.txt')

import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

from tests.conftest import ROOT
from tests.runs import host_xla_flags

pytestmark = pytest.mark.slow  # real processes and runs: outside the edit loop's tier


def test_quickstart_notebook_runs_top_to_bottom(tmp_path):
    notebook = nbformat.read(ROOT / 'notebooks' / 'vrl_quickstart.ipynb', as_version=4)
    parameters = [c for c in notebook.cells if 'parameters' in c.metadata.get('tags', [])]
    assert len(parameters) == 1
    parameters[0].source += f'\nSTEPS = 8\nWORKDIR = {str(tmp_path / "quickstart")!r}\n'
    NotebookClient(
        notebook,
        timeout=1200,
        kernel_name='python3',  # on one CPU device, as a laptop or Colab's CPU
        resources={'metadata': {'path': str(ROOT)}},
    ).execute(env={**os.environ, 'XLA_FLAGS': host_xla_flags(1)})
    outputs = [o for c in notebook.cells if c.cell_type == 'code' for o in c.outputs]
    assert not [o for o in outputs if o.output_type == 'error']
    images = [o for o in outputs if o.output_type == 'display_data' and 'image/png' in o.data]
    assert len(images) == 3  # eval loss, relative training loss, entropy
    text = ''.join(o.get('text', '') for o in outputs if o.output_type == 'stream')
    assert 'ROMEO:' in text and '| resformer |' in ''.join(
        o.data.get('text/markdown', '') for o in outputs if o.output_type == 'display_data'
    )
    assert (tmp_path / 'quickstart' / 'report.md').exists()
