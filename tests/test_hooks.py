"""The train loop's signal handling outside a run: what a first and a second Ctrl-C do."""

import os
import signal

import pytest

from vrl.train import hooks


def test_a_first_ctrl_c_asks_for_a_save_and_a_second_aborts(capsys):
    before = signal.getsignal(signal.SIGINT)
    preemption = hooks.Preemption()
    try:
        assert preemption.agree(1, 1, lease_lost=False) == (False, {'lease_lost': False})
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before the next bytecode
        assert preemption.agree(2, 1, lease_lost=False) == (True, {'lease_lost': False})
        assert capsys.readouterr().out == ('Ctrl-C: the run saves a checkpoint at the next step that checks for it '
                                           '(within train.log_every steps; the steps already sent to the device '
                                           'finish first), then exits; Ctrl-C again aborts without saving\n')
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        preemption.restore()
    assert signal.getsignal(signal.SIGINT) is before
