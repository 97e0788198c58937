"""The train loop's hooks outside a run: the steps the registry runs each at; what a first and a second Ctrl-C
do; how tokens/s and MFU count time."""

import os
import re
import signal
import time

import numpy as np
import pytest

from vrl.train import hooks, host_metrics
from vrl.train import preemption as preemption_lib


class _Said(hooks.Hook):
    def __init__(self, name: str, said: list):
        self.name, self.said = name, said

    def on_step(self, record: hooks.StepRecord) -> None:
        self.said.append((self.name, record.step))


def _record(step: int, at_end: bool = False, preempted: bool = False, **agreed: bool) -> hooks.StepRecord:
    return hooks.StepRecord(step, {}, None, None, at_end, preempted, {'lease_lost': False, **agreed})


def test_the_registry_runs_each_hook_at_its_cadences_steps_once_a_step():
    """Counts, the end, a flag the processes agreed on, a preemption a scoring hook skips, and the end of
    the data at a step a hook already ran at: each hook runs where its cadence says, in registration
    order, once a step."""
    said, registry = [], hooks.Registry()
    registry.add(_Said('lease', said), hooks.Cadence(when=lambda r: r.agreed['lease_lost']))
    registry.add(_Said('save', said), hooks.Cadence(every=4, at_end=True, when=lambda r: r.preempted))
    registry.add(_Said('score', said), hooks.Cadence(every=2, at_end=True, skip_preempted=True))
    registry.add(_Said('diagnose', said), hooks.Cadence(every=3))
    registry.add(_Said('sample', said))  # at no step
    for record in [_record(s) for s in range(1, 7)] + [_record(7, lease_lost=True), _record(8, preempted=True)]:
        registry.run(registry.due(record), record)
    assert said == [
        ('score', 2),
        ('diagnose', 3),
        ('save', 4),
        ('score', 4),
        ('score', 6),
        ('diagnose', 6),
        ('lease', 7),
        ('save', 8),  # preempted at a step both would run at: the save only
    ]
    said.clear()
    registry.run(registry.due(_record(10)), _record(10))
    ended = hooks.StepRecord.end_of_data(10, None)  # the data ended after step 10, which the score ran at
    registry.run(registry.due(ended), ended)
    assert said == [('score', 10), ('save', 10)]
    said.clear()
    last = _record(11, at_end=True, preempted=True)  # a preemption at train.steps: the end's hooks all run
    registry.run(registry.due(last), last)
    assert said == [('save', 11), ('score', 11)]


def test_a_first_ctrl_c_asks_for_a_save_and_a_second_aborts(capsys):
    before = signal.getsignal(signal.SIGINT)
    preemption = preemption_lib.Preemption()
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
    preemption = preemption_lib.Preemption()

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


def _host_on_a_clock(monkeypatch, config, label: str = ''):
    """HostMetrics of one run on a clock the test moves (`now[0]`, seconds): (host, now, the records
    written by step, the lines printed)."""
    import types

    now = [0.0]
    monkeypatch.setattr(host_metrics.time, 'perf_counter', lambda: now[0])
    logged, said = {}, []
    writer = types.SimpleNamespace(write=lambda step, record: logged.update({step: record}), print=said.append)
    member = types.SimpleNamespace(config=config, label=label, writer=writer)
    group = types.SimpleNamespace(member=lambda tree, i: tree)
    host = host_metrics.HostMetrics(
        config, group, [member], flops_per_token=1e6, peak_flops=1e9, train_tokens={'plays': 1}, start_step=0
    )
    return host, now, logged, said


def test_tokens_per_second_count_the_training_time_of_each_interval_not_the_hooks(monkeypatch, small_corpus):
    """On a clock the test moves: 4 steps of 2 s, then a 100 s evaluation, then 4 more steps of 2 s.
    The second logged interval reports 4 x batch x seq_len tokens over 8 s (the evaluation left out),
    MFU being FLOPs per token x tokens/s over the peak; the first leaves out step 1, the compile."""
    from tests.runs import tiny_config

    config = tiny_config(small_corpus, steps=8, log_every=4)
    host, now, logged, said = _host_on_a_clock(monkeypatch, config)
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
    per_step = config.data.batch_size * config.data.seq_len
    assert sorted(logged) == [4, 8]
    assert said == [
        'step 1: compiled and trained in 4 s (loss 3.0000); the log follows every 4 steps'
    ]  # read a step late
    # the first interval starts where step 1 (its compile) is read, at 4 s, when step 2 has also run
    # (this clock runs each step as it is sent): steps 3-4 by 8 s
    assert logged[4]['tokens_per_sec'] == pytest.approx(2 * per_step / 4.0) and logged[4]['step_time'] == 2.0
    assert logged[8]['tokens_per_sec'] == pytest.approx(4 * per_step / 8.0) and logged[8]['step_time'] == 2.0
    assert logged[8]['mfu'] == pytest.approx(1e6 * 4 * per_step / 8.0 / 1e9)


class _Finishing:
    """A device value of a step that finishes at `at` on the test's clock `now`: reading it waits."""

    def __init__(self, value, at: float, now: list[float]):
        self.value, self.at, self.now = value, at, now

    def block_until_ready(self):
        self.now[0] = max(self.now[0], self.at)
        return self

    def __float__(self):
        return float(self.block_until_ready().value)

    def __bool__(self):
        return bool(self.block_until_ready().value)


@pytest.mark.parametrize('device', ['runs-when-sent', 'runs-after-sent'])
def test_tokens_per_second_at_log_every_1_are_each_steps_rate_beside_saves_and_evaluations(
    monkeypatch, small_corpus, device
):
    """Steps of 2 s of device time at train.log_every=1, with 10 s of hooks at every even step (which
    reads its step early, before it saves or evaluates): every line says 2 s a step, whether the
    device runs a step while it is sent (a CPU, often) or after (an accelerator's queue). Reading a
    step one late made the even steps' interval nearly empty: tokens/s 100x too high."""
    from tests.runs import tiny_config

    config = tiny_config(small_corpus, steps=8, log_every=1)
    host, now, logged, _ = _host_on_a_clock(monkeypatch, config)
    finished = 0.0
    for step in range(1, 9):
        finished = max(finished, now[0]) + 2.0  # the step starts when the one before it has finished
        if device == 'runs-when-sent':
            now[0] = finished
        metrics = {
            name: _Finishing(value, finished, now)
            for name, value in {'loss': 3.0, 'lr': 1e-3, 'grad_norm': 1.0, 'finite': True}.items()
        }
        host.take(hooks.StepRecord(step, metrics, None, np.array([step]), step == 8, False, {}))
        if step % 2 == 0:
            host.settle()
            now[0] += 10.0
            host.pause(10.0)
    host.settle()
    assert sorted(logged) == list(range(1, 9))
    assert {step: logged[step]['step_time'] for step in range(2, 9)} == dict.fromkeys(range(2, 9), 2.0)


def test_a_two_step_run_logs_its_last_step_with_the_interval_that_timed_it(monkeypatch, small_corpus):
    """train.steps=2 at log_every=4: step 1's read (in step 2's take) ends the first interval where step
    2 has also finished, so the last step, logged at the end, repeats that interval's figures (the
    compile among them) rather than logging none."""
    from tests.runs import tiny_config

    config = tiny_config(small_corpus, steps=2, log_every=4)
    host, now, logged, _ = _host_on_a_clock(monkeypatch, config)
    for step in (1, 2):
        now[0] += 3.0
        metrics = {'loss': np.float32(3.0), 'lr': np.float32(1e-3), 'grad_norm': np.float32(1.0), 'finite': True}
        host.take(hooks.StepRecord(step, metrics, None, np.array([step]), step == 2, False, {}))
    host.settle()
    assert sorted(logged) == [2] and logged[2]['step_time'] == 3.0, logged


def test_a_run_that_records_every_step_but_prints_later_says_its_first_step(monkeypatch, small_corpus):
    """compare and study record every step (train.log_every=1) and print every train.print_every: the
    first step's line still says how long the compile took, and which steps the log follows."""
    from tests.runs import tiny_config

    config = tiny_config(small_corpus, steps=8, log_every=1, print_every=4)
    host, now, logged, said = _host_on_a_clock(monkeypatch, config, label='[vanilla-s0] ')
    for step in range(1, 9):
        now[0] += 1.0
        metrics = {'loss': np.float32(3.0), 'lr': np.float32(1e-3), 'grad_norm': np.float32(1.0), 'finite': True}
        host.take(hooks.StepRecord(step, metrics, None, np.array([step]), step == 8, False, {}))
    host.settle()
    assert sorted(logged) == list(range(1, 9))
    assert len(said) == 1 and re.fullmatch(
        r'step 1: compiled and trained in \d+ s \(loss 3.0000\); the log follows every 4 steps', said[0]
    ), said


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


def test_the_cpu_peak_is_measured_once_idle_kept_and_shared_by_the_hosts_devices(monkeypatch, tmp_path):
    """MFU on a CPU is over a property of the machine: the first probe taken with the cores idle is kept
    (~/.cache/vrl/cpu_peak.json, per CPU model, cores, dtype and matmul kernels) and every later run
    reads it, whatever a later probe would say. The suite's 8 CPU devices share one host's cores: the
    job's peak is one host's, not eight."""
    import json

    import jax

    from vrl.core import backend
    from vrl.train import metrics

    monkeypatch.setenv('HOME', str(tmp_path))
    monkeypatch.setattr(metrics, 'PROBE_SECONDS', 0.0)
    monkeypatch.setattr(metrics, '_cores_busy_seconds', lambda: 0.0)  # nothing else ran meanwhile

    def probe() -> metrics.Peak:
        metrics.host_matmul_peak.cache_clear()
        return metrics.host_matmul_peak('float32', n=256)

    try:
        first = probe()
        ((key, kept),) = json.loads(metrics.cpu_peak_file().read_text()).items()
        assert key.endswith(f'cores | float32 | {backend.cpu_matmul_path()}') and kept['flops'] == first.flops > 1e8
        assert kept['measured'] == time.strftime('%Y-%m-%d') and kept['others_busy'] == 0.0
        assert first.source == (
            f"this host's float32 matmul rate on {backend.describe_cpu_isa()} with {backend.cpu_matmul_path()} "
            f'kernels, measured idle now, kept in {tmp_path}/.cache/vrl/cpu_peak.json'
        )
        metrics.cpu_peak_file().write_text(json.dumps({key: {**kept, 'flops': 3e10, 'measured': '2026-11-30'}}))
        again = probe()  # the reference stands: no probe replaces it
        assert again.flops == 3e10 and 'measured idle on 2026-11-30' in again.source
        assert json.loads(metrics.cpu_peak_file().read_text())[key]['flops'] == 3e10
        peak = metrics.peak_flops(0.0, 'float32')
        assert len(jax.devices()) == 8 and peak == again
        assert str(peak).startswith("30 GFLOP/s (this host's float32 matmul rate on ")
        assert metrics.peak_flops(2e9, 'float32').flops == 16e9  # train.peak_flops: per device
    finally:
        metrics.host_matmul_peak.cache_clear()


def test_a_cpu_peak_probed_beside_other_work_is_not_kept(monkeypatch, tmp_path):
    """Two processes spinning on this host's cores while the probe runs: /proc/stat shows their CPU
    time, the figure is not kept as the reference, and the run's line says its MFU is provisional."""
    import subprocess
    import sys

    from vrl.train import metrics

    monkeypatch.setenv('HOME', str(tmp_path))
    monkeypatch.setattr(metrics, 'PROBE_SECONDS', 1.0)
    spinners = [
        subprocess.Popen([sys.executable, '-c', 'import time\nend = time.time() + 20\nwhile time.time() < end: pass'])
        for _ in range(2)
    ]
    try:
        time.sleep(0.5)
        metrics.host_matmul_peak.cache_clear()
        peak = metrics.host_matmul_peak('float32', n=256)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        metrics.host_matmul_peak.cache_clear()
    assert re.search(r'measured now, provisional: other work took \d+% of the cores meanwhile', peak.source), peak
    assert not metrics.cpu_peak_file().exists()
