"""The TensorBoard tracker's charts as TensorBoard reads them, written by a process that never loads torch."""

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import tensorboard_scalars


@pytest.mark.skipif(
    importlib.util.find_spec('torch') is None,
    reason='tensorboardX loads torch only where it is installed: pip install -r requirements-extra.txt',
)
def test_tensorboard_charts_are_written_without_loading_torch(tmp_path):
    code = (
        'import sys\n'
        'from vrl.train.trackers.tensorboard import TensorBoardTracker\n'
        f'tracker = TensorBoardTracker({str(tmp_path)!r}, 0)\n'
        "tracker.log(3, {'step': 3, 'loss': 2.5, 'lr': float('nan')})\n"
        'tracker.close()\n'
        "print('torch' in sys.modules)\n"
        'import torch\n'  # hidden only while tensorboardX was imported
        'print(torch.ones(2).sum().item())\n'
    )
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ['False', '2.0']
    assert tensorboard_scalars(tmp_path / 'tensorboard') == {('.', 'loss'): [(3, 2.5)]}
