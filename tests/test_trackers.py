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


_FULL_DISK = """
import errno
import tensorboardX.event_file_writer as files

_write, _written = files.EventsWriter._write_serialized_event, [0]


def _filling(self, data):  # the disk fills up after the run's first 40 events
    _written[0] += 1
    if _written[0] > 40:
        raise OSError(errno.ENOSPC, 'No space left on device')
    return _write(self, data)


files.EventsWriter._write_serialized_event = _filling
"""


def test_a_full_disk_under_tensorboards_writer_ends_the_run_in_one_line(small_corpus, tmp_path):
    """The event writer's thread fails on a disk that fills up mid-run (injected: its file writes raise
    ENOSPC after the first 40 events, about 4 steps' records): the run
    stops at its next record with one `error:` line naming the disk's trouble and the event folder, exit 1,
    instead of blocking on the writer's queue for ever; no thread traceback."""
    import dataclasses
    import time

    from tests.helpers import hiding
    from tests.runs import cli_args, tiny_config

    config = tiny_config(small_corpus, steps=400, log_every=1, checkpoint_every=400)
    env = hiding(tmp_path / 'inject')  # hides nothing: its sitecustomize.py is replaced below
    (tmp_path / 'inject' / 'sitecustomize.py').write_text(_FULL_DISK)
    env['PYTHONPATH'] = f'{tmp_path / "inject"}:{ROOT}'
    started = time.monotonic()
    out = subprocess.run(
        cli_args(dataclasses.replace(config), tmp_path / 'run'),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,  # blocked on the queue, it never ends
    )
    assert out.returncode == 1 and time.monotonic() - started < 120, out.stderr[-3000:]
    assert out.stderr == (
        f'error: no space left on device writing {tmp_path / "run" / "tensorboard"}; free space and run the same '
        'command to resume.\n'
    ), out.stderr[-3000:]
    assert 'Traceback' not in out.stdout
