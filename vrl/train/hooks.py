"""What happens around training steps, each at the steps of its cadence: checkpoints, evaluation,
diagnostics, the lease, and the sample at the end (the step's metrics: vrl/train/host_metrics.py; a
preemption: vrl/train/preemption.py).

Each hook is registered with its `Cadence` in a `Registry` (the loop's `step_hooks`); the loop hands the
registry a `StepRecord` after every step and it runs the hooks due then, each once a step. Before any
hook runs, the step passes the NaN policy (the loop reads its metrics at once): a checkpoint or an
evaluation never sees a non-finite step. A group of runs (seeds trained in one step) is the `Member`s
a hook serves: each hook splits a record per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from vrl.core import multihost
from vrl.data import pipeline
from vrl.model import decode
from vrl.train.config import Config
from vrl.train.rundir import checkpoint
from vrl.train.rundir import guard as guard_lib
from vrl.train.start import Start
from vrl.train.step import RunGroup, TrainState
from vrl.train.trackers.composite import Trackers

SILENT_WAIT_SECONDS = 2.0  # a wait longer than this is said on the terminal


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a group (or the run alone), host side: its config, workdir, the guard that keeps it
    (process 0's), the label before its lines, its checkpoint manager, its metrics writer (whose
    `print` is how the run's lines reach the terminal) and where it starts."""

    config: Config
    path: epath.Path
    guard: guard_lib.Guard
    label: str
    manager: ocp.CheckpointManager
    writer: Trackers
    start: Start


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What step `step` left: its device-side metrics and the state after it (a group's: a leading
    run axis), the target tokens read from each dataset up to it (this process's), whether it is
    train.steps, and what every process agreed on after it (preemption, the hooks' flags)."""

    step: int
    metrics: dict[str, jax.Array]
    state: TrainState
    tokens_read: np.ndarray | None
    at_end: bool  # the run's last step: train.steps, or the last step of data that ended early
    preempted: bool
    agreed: dict[str, bool]
    data_ended: bool = False  # no new step: data.num_epochs passes ended after `step`, before train.steps

    @classmethod
    def end_of_data(cls, step: int, state: TrainState) -> StepRecord:
        """The run's last step when its data ended early (the hooks saw its own record already), for
        the hooks due at the end."""
        return cls(step, {}, state, None, at_end=True, preempted=False, agreed={}, data_ended=True)


class Hook:
    """Something done at the steps its registration's `Cadence` picks; a new one is a subclass and
    one `Registry.add` in the loop, touching no other hook."""

    def flags(self) -> dict[str, bool]:
        """Local conditions that every process must agree on (gathered every train.log_every steps)."""
        return {}

    def poll(self) -> None:
        """Every step, right after it is dispatched."""

    def on_step(self, record: StepRecord) -> None:
        """At a step the hook's cadence picked."""

    def end(self, step: int, state: TrainState) -> None:
        """After the last step, also a preemption's: what is in flight is finished."""

    def finish(self, step: int, state: TrainState) -> None:
        """After `end`, when the run trained to its last step or to the end of its data (not preempted)."""


@dataclasses.dataclass(frozen=True)
class Cadence:
    """The steps a registered hook runs at: every `every` steps (0: none by count), the run's last step
    (`at_end`), and the steps `when` picks (an agreed flag, a schedule's turn, a preemption).
    `skip_preempted`: not at a preemption's step (unless it is the last), whose notice leaves time to
    save, not to score."""

    every: int = 0
    at_end: bool = False
    when: Callable[[StepRecord], bool] | None = None
    skip_preempted: bool = False

    def due(self, record: StepRecord) -> bool:
        if record.at_end and self.at_end:
            return True
        if (record.preempted and self.skip_preempted) or record.data_ended:
            return False
        return (bool(self.every) and record.step % self.every == 0) or bool(self.when and self.when(record))


class Registry:
    """A run's hooks, each with its cadence, in the order they run: the loop's one way to them. A hook
    runs at most once a step (a step both due by count and the end of the data runs it once)."""

    def __init__(self):
        self._cadences: dict[Hook, Cadence] = {}
        self._ran_at: dict[Hook, int] = {}

    def add(self, hook: Hook, cadence: Cadence = Cadence()) -> None:
        self._cadences[hook] = cadence

    def flags(self) -> dict[str, bool]:
        """Every hook's local flags, for the processes to agree on."""
        return {name: flag for hook in self._cadences for name, flag in hook.flags().items()}

    def poll(self) -> None:
        for hook in self._cadences:
            hook.poll()

    def due(self, record: StepRecord) -> list[Hook]:
        return [h for h, c in self._cadences.items() if c.due(record) and self._ran_at.get(h) != record.step]

    def run(self, hooks: list[Hook], record: StepRecord) -> None:
        """`hooks` (what `due` chose for `record`), in registration order."""
        for hook in hooks:
            self._ran_at[hook] = record.step
            hook.on_step(record)

    def end(self, step: int, state: TrainState) -> None:
        for hook in self._cadences:
            hook.end(step, state)

    def finish(self, step: int, state: TrainState) -> None:
        for hook in self._cadences:
            hook.finish(step, state)


def confirm(guards: list[guard_lib.Guard]) -> None:
    """Every process stops (LeaseLostError, one line) unless process 0 surely still holds each workdir."""
    multihost.on_process_0(lambda: [guard.confirm() for guard in guards])


@contextlib.contextmanager
def lease_first(guard: guard_lib.Guard) -> Iterator[None]:
    """A failed save of a run that lost its lease stops it on that (LeaseLostError), not on what its
    late writes met."""
    try:
        yield
    except checkpoint.SaveError:
        guard.confirm()
        raise


def check_saves(manager: ocp.CheckpointManager, guard: guard_lib.Guard, wait: bool = False) -> None:
    """checkpoint.check_saves for a run's manager (`lease_first`)."""
    with lease_first(guard):
        checkpoint.check_saves(manager, wait)


@contextlib.contextmanager
def said_when_slow(say: Callable[[str], None], doing: str, done: str) -> Iterator[None]:
    """A block that may wait on the store: once it has taken SILENT_WAIT_SECONDS, `doing ...` is said
    (from a timer thread), and when it ends, `done in N s`; a quick block says nothing."""
    started, fired = time.monotonic(), threading.Event()

    def tell() -> None:
        fired.set()
        say(f'{doing} ...')

    timer = threading.Timer(SILENT_WAIT_SECONDS, tell)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a `tell` under way has finished: `fired` is final
        if fired.is_set():
            say(f'{done} in {time.monotonic() - started:.0f} s')


class Leases(Hook):
    """A workdir's lease lost on any process (another run took the bucket workdir) stops every
    process, in one line, at the next agreement."""

    def __init__(self, members: list[Member]):
        self.members = members

    def confirm(self) -> None:
        confirm([m.guard for m in self.members])

    def flags(self) -> dict[str, bool]:
        return {'lease_lost': any(m.guard.lost for m in self.members)}

    def on_step(self, record: StepRecord) -> None:
        self.confirm()


def save_steps(config: Config) -> Cadence:
    """When a run saves: every train.checkpoint_every steps, at the end, at a preemption, after
    train.checkpoint_minutes without a save (the agreed `timed_save`) and at the end of WSD's stable
    phase (a run to extend from)."""
    opt = config.optimizer
    stable_end = opt.decay_start if opt.schedule == 'wsd' else None

    def also(record: StepRecord) -> bool:
        return record.preempted or record.step == stable_end or record.agreed['timed_save']

    return Cadence(every=config.train.checkpoint_every, at_end=True, when=also)


class Checkpoints(Hook):
    """Saves the runs' state at the steps of its cadence (`save_steps`); a failed asynchronous save
    stops the run at the next step."""

    def __init__(
        self,
        config: Config,
        group: RunGroup,
        members: list[Member],
        leases: Leases,
        data_iterator: grain.DatasetIterator,
        start_step: int,
    ):
        self.config, self.group, self.members, self.leases = config, group, members, leases
        self._data_iterator = data_iterator
        self._saved_at = time.monotonic()  # train.checkpoint_minutes' clock
        self.last_saved = start_step  # a resumed run's step is saved; a fresh run's step 0 is not asked for

    def flags(self) -> dict[str, bool]:
        minutes = self.config.train.checkpoint_minutes
        return {'timed_save': bool(minutes) and time.monotonic() - self._saved_at >= 60 * minutes}

    def poll(self) -> None:
        for m in self.members:
            check_saves(m.manager, m.guard)

    def on_step(self, record: StepRecord) -> None:
        if record.step != self.last_saved:  # a resumed run whose data ended at its first step has it saved
            self.save(record.step, record.state, force=record.preempted or record.at_end)

    def save(self, step: int, state: TrainState, force: bool) -> None:
        self.leases.confirm()
        self._saved_at, self.last_saved = time.monotonic(), step
        for i, m in enumerate(self.members):
            m.writer.flush(wait=True)  # on an object store, every step's metrics are there before its checkpoint
            with (
                lease_first(m.guard),
                said_when_slow(
                    m.writer.print, f'starting the save of step {step} in {m.path}', f'the save of step {step} started'
                ),
            ):
                checkpoint.save(
                    m.manager, step, self.group.member(state, i), self._data_iterator, m.config, force=force
                )

    def wait(self) -> None:
        """Until the saves in flight are written."""
        for m in self.members:
            with said_when_slow(
                m.writer.print,
                f'writing the checkpoint of step {self.last_saved} to {m.path}',
                f'checkpoint of step {self.last_saved} written',
            ):
                check_saves(m.manager, m.guard, wait=True)

    def end(self, step: int, state: TrainState) -> None:
        self.wait()


class Scoring(Hook):
    """A hook that scores the parameters at the steps it is due (validation, downstream tasks):
    `evaluate` scores a step once."""

    scored_at: int | None = None

    def on_step(self, record: StepRecord) -> None:
        self.evaluate(record.step, record.state)

    def evaluate(self, step: int, state: TrainState) -> None:
        if step != self.scored_at:
            self.scored_at = step
            self.score(step, state)

    def score(self, step: int, state: TrainState) -> None:
        """Scores `state` at `step`, each run's record written."""


class Evaluation(Scoring):
    """Validation of each run, its record written."""

    def __init__(self, members: list[Member], validate: Callable[[Any], list[Any]]):
        self.members, self._validate = members, validate
        self.eval_losses: list[float | None] = [None] * len(members)  # per member: its last validation loss

    def score(self, step: int, state: TrainState) -> None:
        for i, (m, evaluation) in enumerate(zip(self.members, self._validate(state.params))):
            self.eval_losses[i] = evaluation.loss
            m.writer.write(step, evaluation.record())
            m.writer.flush()


class Diagnostics(Hook):
    """The attention and value statistics of each run (vrl/train/diagnostics.py)."""

    def __init__(self, group: RunGroup, members: list[Member], diagnose: Callable[[Any], dict]):
        self.group, self.members, self._diagnose = group, members, diagnose

    def on_step(self, record: StepRecord) -> None:
        for i, m in enumerate(self.members):
            m.writer.write_diagnostics(record.step, self._diagnose(self.group.member(record.state.params, i)))


class Sample(Hook):
    """A greedy sample of each run at the end of a run that trained, prompted with train.sample_prompt
    or the opening words of the run's own validation data: the prompt in brackets, then what the
    model wrote, its trailing blank lines left out."""

    def __init__(
        self,
        config: Config,
        group: RunGroup,
        members: list[Member],
        graphdef: Any,
        mesh: Any,
        tokenizer: Any,
        start_step: int,
    ):
        self.config, self.group, self.members, self.graphdef, self.mesh = config, group, members, graphdef, mesh
        self.tokenizer, self.start_step = tokenizer, start_step

    def finish(self, step: int, state: TrainState) -> None:
        if step <= self.start_step:
            return
        config = self.config
        text = config.train.sample_prompt or pipeline.opening_words(config.data, self.tokenizer)
        prompt = pipeline.prompt_tokens(config.data, self.tokenizer, text)
        sampling = decode.Sampling(max_new_tokens=min(config.train.sample_tokens, config.data.seq_len - len(prompt)))
        for i, m in enumerate(self.members):
            generator = decode.Generator(
                config.model,
                self.graphdef,
                self.group.member(state.params, i),
                config.data.seq_len,
                self.tokenizer.eos_id,
                self.mesh,
            )
            completion = generator.generate([prompt], sampling).tokens[0]
            continuation = self.tokenizer.decode(completion).rstrip()  # not the blank lines a tiny model ends on
            m.writer.print(f'sample (greedy): [{text}]{continuation}')
