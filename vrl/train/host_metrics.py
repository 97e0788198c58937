"""The host side of each step's metrics: read one step late, so the device never waits on logging;
the NaN policy, the loss record, the log line with tokens/s and MFU."""

from __future__ import annotations

import logging
import time

import jax

from vrl.core import multihost
from vrl.train.config import Config
from vrl.train.hooks import Member, StepRecord
from vrl.train.start import TrainingError
from vrl.train.step import RunGroup
from vrl.train.trackers import terminal

INITIALISED_STEPS = 10  # a non-finite step within this many of an --init_from start names the source


class HostMetrics:
    """The host side of each step, one step late: train.nan_policy, the loss record, and every
    train.log_every steps the log line (with the tokens read from each dataset, summed over the
    processes); at the end, a run that skipped most of its steps is an error. tokens/s and MFU are
    an interval's tokens over its wall time less the hooks' (`pause`). An interval ends where every
    step sent to the device so far has finished (the log line waits for the newest), so its steps
    and its time agree whether the device ran a step while it was sent (a CPU often does) or later;
    a logged step that the last interval already timed (a step read early for its hooks, the last
    step) repeats that interval's figures. The first interval, which holds the compile, ends with
    the first step's read: its figures are logged only for a step it timed."""

    def __init__(
        self,
        config: Config,
        group: RunGroup,
        members: list[Member],
        flops_per_token: float,
        peak_flops: float,
        train_tokens: dict[str, int],
        start_step: int,
    ):
        self.config, self.group, self.members = config, group, members
        self._flops_per_token, self._peak, self._train_tokens = flops_per_token, peak_flops, train_tokens
        self._start_step = start_step
        self.losses: list[dict[int, float]] = [{} for _ in members]  # per member: every step's loss
        self._skipped = [0] * len(members)
        self._skipped_in_a_row = [0] * len(members)
        self._pending: StepRecord | None = None
        self._newest: StepRecord | None = None  # the last step sent to the device
        self._interval_start, self._interval_from, self._paused = time.perf_counter(), start_step, 0.0
        self._rates: dict[str, float] = {}  # the last interval's figures
        self._began = time.perf_counter()  # this invocation's training: its records' wall_seconds count from here

    def pause(self, seconds: float) -> None:
        """`seconds` of the current interval went to the hooks (an evaluation, downstream scores, a
        save), not to training: tokens/s and MFU leave them out."""
        self._paused += seconds

    def take(self, record: StepRecord) -> None:
        """Reads the step before `record`'s, and holds `record`'s for the next step."""
        self._newest = record
        self.settle()
        self._pending = record

    def settle(self) -> None:
        """Reads the held step now."""
        if self._pending is not None:
            self._read(self._pending)
            self._pending = None

    def _read(self, record: StepRecord) -> None:
        config, step = self.config, record.step
        host = jax.device_get(record.metrics)
        logging_now = step % config.train.log_every == 0 or step == config.train.steps
        interval_ends = logging_now or step == self._start_step + 1  # the first interval leaves the compile out
        if interval_ends:
            jax.block_until_ready(self._newest.metrics)
            now, newest = time.perf_counter(), self._newest.step
            if newest > self._interval_from:
                elapsed = now - self._interval_start - self._paused
                tokens_per_sec = (newest - self._interval_from) * config.data.batch_size * config.data.seq_len / elapsed
                self._rates = {
                    'tokens_per_sec': tokens_per_sec,
                    'step_time': elapsed / (newest - self._interval_from),
                    'mfu': self._flops_per_token * tokens_per_sec / self._peak,
                }
        if logging_now:
            read = dict(zip(self._train_tokens, multihost.summed(record.tokens_read).tolist()))
            shared = {
                **self._rates,
                'wall_seconds': time.perf_counter() - self._began,
                **{f'tokens/{name}': n for name, n in read.items()},
                **{f'epoch/{name}': n / max(self._train_tokens[name], 1) for name, n in read.items()},
            }
        printed = logging_now and terminal.prints_at(step, config.train.print_every, config.train.steps)
        first = step == self._start_step + 1 and not printed  # what the silent minutes before it were
        for i, m in enumerate(self.members):
            mine = self.group.member(host, i)
            self._check_finite(i, step, bool(mine['finite']))
            self.losses[i][step] = float(mine['loss'])
            if logging_now:
                m.writer.write(step, {'loss': mine['loss'], 'lr': mine['lr'], 'grad_norm': mine['grad_norm'], **shared})
            if first:
                m.writer.print(
                    f'step {step}: compiled and trained in {time.perf_counter() - self._interval_start:.0f} s '
                    f'(loss {float(mine["loss"]):.4f}); the log follows every '
                    f'{config.train.print_every or config.train.log_every} steps'
                )
        if interval_ends:
            self._interval_start, self._interval_from, self._paused = now, newest, 0.0

    def check_skipped(self, step: int) -> None:
        for m, skipped in zip(self.members, self._skipped):
            if 2 * skipped > step - self._start_step:
                raise TrainingError(
                    f'{m.label}{skipped} of the {step - self._start_step} steps this run took were '
                    'non-finite and skipped (train.nan_policy=skip): the run is not learning; lower '
                    f'the LR. The checkpoint of step {step} holds the weights of the last finite step.'
                )

    def _check_finite(self, i: int, step: int, finite: bool) -> None:
        """train.nan_policy for one step of member i: stop ('error', or too many skipped) or count the skip."""
        m, train_cfg = self.members[i], self.config.train
        if finite:
            self._skipped_in_a_row[i] = 0
            return
        if train_cfg.nan_policy == 'error':
            source = m.start.source
            causes = (
                f'Lower the LR, or check the weights it started from: --init_from={source.where} (step '
                f'{source.step}, parameters {source.fingerprint}) may be damaged or of another scale; '
                'train.nan_policy=skip would hide either.'
                if source and step - self._start_step <= INITIALISED_STEPS
                else 'Lower the LR or set train.nan_policy=skip.'
            )
            raise TrainingError(
                f'{m.label}non-finite loss, gradients or weights at step {step}; no checkpoint '
                f'of it was written (latest saved: {m.manager.latest_step()}). {causes}'
            )
        self._skipped_in_a_row[i] += 1
        self._skipped[i] += 1
        if self._skipped_in_a_row[i] > train_cfg.max_skipped_steps:
            raise TrainingError(
                f'{m.label}{self._skipped_in_a_row[i]} steps in a row up to step {step} were '
                f'non-finite and skipped (train.max_skipped_steps={train_cfg.max_skipped_steps}): '
                'the run is not learning; lower the LR.'
            )
        logging.warning('%sstep %d: non-finite loss, gradients or weights; update skipped', m.label, step)
