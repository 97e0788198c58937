"""The train loop's hooks outside a run: what a first and a second Ctrl-C do; how tokens/s and MFU count time."""

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
        assert capsys.readouterr().out == (
            'Ctrl-C: the run saves a checkpoint at the next step that checks for it '
            '(within train.log_every steps; the steps already sent to the device '
            'finish first), then exits; Ctrl-C again aborts without saving\n'
        )
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        preemption.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_that_lands_inside_a_print_is_said_after_it(capsys):
    """The signal's handler runs between two bytecodes of whatever the main thread does, a print among
    them: its line must wait for that print, not re-enter the stream (RuntimeError: reentrant call)."""
    import io
    import sys

    before = signal.getsignal(signal.SIGINT)
    preemption = hooks.Preemption()

    class Interrupted(io.RawIOBase):  # a terminal at which a Ctrl-C arrives while a line is written
        def __init__(self):
            self.written = bytearray()

        def writable(self):
            return True

        def write(self, data):
            if not preemption.requested:
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs inside this write
            self.written += data
            return len(data)

    raw = Interrupted()
    stream = io.TextIOWrapper(io.BufferedWriter(raw), write_through=True)
    stdout, sys.stdout = sys.stdout, stream
    try:
        print('step 7/100  loss 5.1234', flush=True)
        assert preemption.agree(8, 1) == (True, {})
    finally:
        sys.stdout = stdout
        preemption.restore()
    assert signal.getsignal(signal.SIGINT) is before
    lines = raw.written.decode().splitlines()
    assert lines[0] == 'step 7/100  loss 5.1234' and lines[1].startswith('Ctrl-C: the run saves a checkpoint'), lines


def test_tokens_per_second_count_the_training_time_of_each_interval_not_the_hooks(monkeypatch, small_corpus):
    """On a clock the test moves: 4 steps of 2 s, then a 100 s evaluation, then 4 more steps of 2 s.
    Each logged interval reports 4 x batch x seq_len tokens over 8 s (the evaluation left out), and
    MFU is FLOPs per token x tokens/s over the peak."""
    import types

    import numpy as np

    from tests.runs import tiny_config

    config = tiny_config(small_corpus, steps=8, log_every=4)
    now = [0.0]
    monkeypatch.setattr(hooks.time, 'perf_counter', lambda: now[0])
    logged, said = {}, []
    writer = types.SimpleNamespace(write=lambda step, record: logged.update({step: record}), print=said.append)
    member = types.SimpleNamespace(config=config, label='', writer=writer)
    group = types.SimpleNamespace(member=lambda tree, i: tree)
    host = hooks.HostMetrics(
        config, group, [member], flops_per_token=1e6, peak_flops=1e9, train_tokens={'plays': 1}, start_step=0
    )
    for step in range(1, 9):
        now[0] += 2.0
        metrics = {
            'loss': np.float32(3.0),
            'lr': np.float32(1e-3),
            'grad_norm': np.float32(1.0),
            'finite': np.bool_(True),
        }
        host.take(hooks.StepRecord(step, metrics, None, np.array([step]), step == 8, False, {}))
        if step == 4:
            host.settle()
            now[0] += 100.0  # the hooks due at step 4: an evaluation
            host.pause(100.0)
    host.settle()
    tokens = 4 * config.data.batch_size * config.data.seq_len
    assert sorted(logged) == [4, 8]
    assert said == [
        'step 1: compiled and trained in 4 s (loss 3.0000); the log follows every 4 steps'
    ]  # read a step late
    for step in (4, 8):
        assert logged[step]['tokens_per_sec'] == pytest.approx(tokens / 8.0) and logged[step]['step_time'] == 2.0
        assert logged[step]['mfu'] == pytest.approx(1e6 * tokens / 8.0 / 1e9)


def test_the_terminal_prints_training_lines_at_print_every_and_at_the_last_step(capsys):
    """compare and study record every step (their curves need each loss) and print at the config's
    log_every: TerminalTracker's print_every."""
    from vrl.train.trackers.terminal import TerminalTracker

    terminal = TerminalTracker(total_steps=7, start_step=0, label='[vanilla-s0] ', print_every=3)
    for step in range(1, 8):
        terminal.log(step, {'loss': 3.0, 'lr': 1e-3, 'tokens_per_sec': 1e4, 'mfu': 0.1, 'step_time': 0.1})
    terminal.log(7, {'eval_loss': 2.5, 'eval_perplexity': 12.18, 'eval_bpb': 1.1})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ['3/7', '6/7', '7/7', '7:'] and lines[0].startswith(
        '[vanilla-s0] step'
    )


def test_the_cpu_peak_is_the_best_this_host_has_shown_and_shared_by_its_devices(monkeypatch, tmp_path):
    """MFU on a CPU is over this host's matmul rate: a probe taken beside other work reads low, so the
    best rate this CPU has shown is kept (~/.cache/vrl/cpu_peak.json) and used; a lower kept figure
    is replaced by the probe's. The 8 CPU devices of the suite share the host's cores: the job's peak
    is one host's, not eight."""
    import json

    import jax

    from vrl.train import metrics

    monkeypatch.setenv('HOME', str(tmp_path))
    monkeypatch.setattr(metrics, 'PROBE_SECONDS', 0.0)

    def probe() -> float:
        metrics.host_matmul_peak.cache_clear()
        return metrics.host_matmul_peak('float32', n=256)

    def keep(flops: float) -> None:
        metrics.cpu_peak_file().write_text(json.dumps({key: flops}))

    try:
        first = probe()
        ((key, kept),) = json.loads((tmp_path / '.cache/vrl/cpu_peak.json').read_text()).items()
        assert kept == first > 1e8 and key.endswith('cores | float32'), (key, kept)
        keep(first * 100)  # a quieter moment's figure
        assert probe() == first * 100
        keep(1e3)  # a figure from a probe beside heavy work
        again = probe()
        assert 1e8 < again < first * 100 and json.loads(metrics.cpu_peak_file().read_text()) == {key: again}
        peak = metrics.peak_flops(0.0, 'float32')  # its own probe (n = 1024), kept under the same key
        assert len(jax.devices()) == 8 and peak.flops == metrics.host_matmul_peak('float32') >= again
        assert str(peak) == (
            f"{peak.flops / 1e9:,.3g} GFLOP/s (this host's best measured float32 matmul rate, kept in "
            f'{tmp_path}/.cache/vrl/cpu_peak.json)'
        )
        assert metrics.peak_flops(2e9, 'float32').flops == 16e9  # train.peak_flops: per device
    finally:
        metrics.host_matmul_peak.cache_clear()
