"""The training loop: data -> jitted step -> hooks (vrl/train/hooks.py: the step's metrics, read
one step late so the device never waits on logging; checkpoints; evaluation; diagnostics; the
lease; a sample at the end). What a run depends on is settled before it, once (vrl/train/plan.py).

SIGTERM (what Cloud TPU sends before preemption, seen at every step on every host) and a first
Ctrl-C finish the current step, save, wait for the save to be durable and return normally (a
second Ctrl-C aborts). Process 0 holds the workdir's guard for the whole run (vrl/train/rundir/guard.py);
where a run starts from is vrl/train/start.py's decision.

`run_group` trains runs that differ only in seed with one step over a run axis (vrl/train/step.py's
RunGroup), each in its own workdir with its own checkpoints, metrics and evals, as `run` would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from vrl.core import multihost, peers, storage
from vrl.data import pipeline
from vrl.model import accounting
from vrl.train import diagnostics, downstream, hooks, host_metrics, optimizer, plan, start, validation
from vrl.train import preemption as preemption_lib
from vrl.train.config import Config
from vrl.train.rundir import checkpoint
from vrl.train.rundir import guard as guard_lib
from vrl.train.rundir import workdir as workdir_lib
from vrl.train.start import TrainingError
from vrl.train.step import RunGroup, TrainState, TrainSteps
from vrl.train.trackers.composite import Trackers


@dataclasses.dataclass
class RunResult:
    step: int
    losses: dict[int, float]  # every step this run executed
    eval_loss: float | None
    state: TrainState
    preempted: bool


def run(
    config: Config,
    workdir: str,
    fresh: bool = False,
    init_from: str | None = None,
    branch_from: str | None = None,
    take_over_lease: bool = False,
) -> RunResult:
    """Trains `config` in `workdir`, resuming from its latest intact checkpoint; `fresh` starts over,
    moving the old run aside (vrl/train/rundir/workdir.py). A workdir without a checkpoint starts from `init_from`'s
    parameters, or from `branch_from`'s whole state (a step folder of another run), or at random.
    WorkdirError if another run holds the workdir (`take_over_lease`: a workdir on a bucket is taken
    from a holder known to be gone, at once)."""
    return run_group([config], [workdir], fresh, init_from, branch_from, take_over_lease)[0]


def group_key(config: Config) -> Config:
    """What runs trained together must share: everything but the init seed (train.seed)."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, seed=0))


def run_group(
    configs: list[Config],
    workdirs: list[str],
    fresh: bool = False,
    init_from: str | None = None,
    branch_from: str | None = None,
    take_over_lease: bool = False,
) -> list[RunResult]:
    """Trains runs that differ only in train.seed together (vrl/train/step.py's RunGroup: one compiled step
    over a run axis, one shared batch stream), each in its own workdir exactly as `run` would train it
    alone: its checkpoints, metrics, eval and config.json. Every member must resume from the same step
    (a fresh member: step 0). `init_from` and `branch_from` are for a run alone."""
    request = start.Request(fresh, init_from, branch_from, take_over_lease)
    request.check(len(configs))
    if len({group_key(c) for c in configs}) > 1:
        raise TrainingError('runs trained together must differ only in train.seed; train the others apart.')
    paths = [storage.path(w) for w in workdirs]  # local ones absolute, as Orbax needs
    guards = [
        guard_lib.make(path, 'run', c.train.lease_stale_seconds, take_over_lease) for path, c in zip(paths, configs)
    ]
    preemption = preemption_lib.Preemption()  # from here on, a signal during setup or the first compile saves too
    # another process's failure ends this one from a watcher thread: the lease goes with it
    forget = peers.on_stop(lambda: [guard_lib.release(guard) for guard in guards])
    try:  # process 0 writes the runs' shared files; every process stops if it cannot
        multihost.on_process_0(lambda: [guard_lib.hold(guard) for guard in guards])
        return _run(configs, paths, guards, request, preemption)
    finally:
        forget()
        preemption.restore()
        for guard in guards:
            guard_lib.release(guard)


def _run(
    configs: list[Config],
    paths: list[epath.Path],
    guards: list[guard_lib.Guard],
    request: start.Request,
    preemption: preemption_lib.Preemption,
) -> list[RunResult]:
    """The runs' plan (vrl/train/plan.py), then their compiled step, data and workdirs; each member's
    start, then `_train`; whatever ends it, the saves in flight are waited for (unless another run
    took a workdir) and everything is closed."""
    is_writer = jax.process_index() == 0
    say = print if is_writer else (lambda line: None)
    settled = plan.settle(configs, paths, guards, request, say)
    trainer = TrainSteps(settled.config, settled.mesh)
    group = trainer.group(len(configs))
    dataset = settled.train_data.dataset(*settled.row_share)
    hooks.confirm(guards)  # the compile may have taken long
    if is_writer and request.fresh:
        for run in settled.runs:
            say(run.label + workdir_lib.start_over(run.path, run.config, checkpoint.latest_step(run.path)))
    multihost.sync('vrl workdir ready')
    for guard, epoch in zip(guards, multihost.summed(np.array([g.epoch if is_writer else 0 for g in guards]))):
        guard.epoch = int(epoch)  # process 0 took the guards: every process names its saves by their epochs
    reads = {'data': pipeline.provenance(settled.config.data, settled.tokenizer)}
    members: list[hooks.Member] = []
    data_iterator = iter(dataset)
    try:
        for run in settled.runs:
            members.append(_open(run, trainer, data_iterator, request, reads, is_writer, say))
        if is_writer and settled.tokenizer_copy:  # once the start is known to load: a refused one leaves nothing
            say(workdir_lib.copy_tokenizer(settled.runs[0].path, *settled.tokenizer_copy))
        return _train(settled, trainer, group, members, reads['data'], data_iterator, request, preemption)
    finally:
        if not any(guard.lost for guard in guards):  # else another run holds a workdir: add nothing there
            try:
                for m in members:
                    hooks.check_saves(m.manager, m.guard, wait=True)
            finally:
                for m in members:
                    _close(m.manager, m.guard, m.writer)
        getattr(data_iterator, 'close', lambda: None)()


def _open(
    run: plan.PlannedRun,
    trainer: TrainSteps,
    data_iterator: grain.DatasetIterator,
    request: start.Request,
    reads: dict[str, Any],
    is_writer: bool,
    say: Callable[[str], None],
) -> hooks.Member:
    """`run`'s workdir opened: its checkpoint manager, where it starts (vrl/train/start.py) and its
    metrics writer; a start that is refused closes what was opened for it."""
    manager, writer = checkpoint.make_manager(str(run.path), run.config, run.guard), None
    try:
        begun = start.decide(
            trainer, run.config, run.path, manager, data_iterator, request, lambda line: say(run.label + line)
        )
        train = run.config.train
        wandb = (run.config, reads) if train.wandb_project else None
        writer = Trackers.open(
            run.path, train.steps, begun.step(), is_writer, run.label, run.guard, wandb, train.print_every
        )
        return hooks.Member(run.config, run.path, run.guard, run.label, manager, writer, begun)
    except BaseException:
        _close(manager, run.guard, writer)
        raise


def _close(manager: ocp.CheckpointManager, guard: guard_lib.Guard, writer: Trackers | None) -> None:
    """A run's checkpoint manager closed (vrl/train/rundir/checkpoint.py's `close`), then its writer."""
    try:
        checkpoint.close(manager, guard.epoch)
    finally:
        if writer is not None:
            writer.close()


def _train(
    settled: plan.RunPlan,
    trainer: TrainSteps,
    group: RunGroup,
    members: list[hooks.Member],
    reads: dict[str, Any],
    data_iterator: grain.DatasetIterator,
    request: start.Request,
    preemption: preemption_lib.Preemption,
) -> list[RunResult]:
    """The start lines, the hooks, then the loop and the end of the run."""
    config = settled.config
    state, start_step = _initial_state(trainer, group, members)
    leases = hooks.Leases(members)
    leases.confirm()
    account = accounting.account(config.model, config.data.seq_len)
    _announce(settled, trainer, group, members, reads, request, account)
    train_tokens = {name: d['train_tokens'] for name, d in reads['datasets'].items()}
    host = host_metrics.HostMetrics(
        config, group, members, account.flops_per_token, settled.peak.flops, train_tokens, start_step
    )
    checkpoints = hooks.Checkpoints(config, group, members, leases, data_iterator, start_step)
    eval_sets = pipeline.EvalSets(config.data, settled.tokenizer)  # opened at the first evaluation, then kept
    evaluation = hooks.Evaluation(members, lambda params: validation.validations(group, params, config, eval_sets))
    train, step_hooks = config.train, hooks.Registry()  # each hook with the steps it runs at, in their order
    step_hooks.add(leases, hooks.Cadence(when=lambda record: record.agreed['lease_lost']))
    step_hooks.add(checkpoints, hooks.save_steps(config))
    step_hooks.add(evaluation, hooks.Cadence(every=train.eval_every, at_end=True))
    if train.diagnostics_every and train.diagnostics_every <= train.steps:
        diagnose = diagnostics.TrainingDiagnostics(trainer, settled.tokenizer)
        step_hooks.add(hooks.Diagnostics(group, members, diagnose), hooks.Cadence(every=train.diagnostics_every))
    if settled.task_manager is not None:
        step_hooks.add(
            downstream.Downstream(config, trainer, group, members, settled.tokenizer, settled.task_manager),
            hooks.Cadence(every=train.downstream_every, at_end=True, skip_preempted=True),
        )
    if train.sample_tokens:  # at the end of a run that trained (`finish`), at no step
        step_hooks.add(
            hooks.Sample(config, group, members, trainer.graphdef, trainer.mesh, settled.tokenizer, start_step)
        )
    if config.train.steps == 0 and members[0].start.origin != start.Origin.RESUMED:  # a conversion: the initial weights
        _save_initial(config, state, members, checkpoints, evaluation)
    state, step, preempted = _loop(config, group, data_iterator, state, start_step, host, step_hooks, preemption)
    if not preempted:
        host.settle()
        step_hooks.end(step, state)
        host.check_skipped(step)
        step_hooks.finish(step, state)
        if step > start_step:
            tell_every_host(
                members,
                [
                    f'done at step {step}: loss {losses[step]:.4f}; checkpoint in '
                    f'{checkpoint.step_path(m.path, checkpoints.last_saved, m.guard.epoch)}'
                    for m, losses in zip(members, host.losses)
                ],
            )
    return [
        RunResult(step, host.losses[i], evaluation.eval_losses[i], group.member(state, i), preempted)
        for i in range(len(members))
    ]


def _loop(
    config: Config,
    group: RunGroup,
    data_iterator: grain.DatasetIterator,
    state: TrainState,
    step: int,
    host: host_metrics.HostMetrics,
    step_hooks: hooks.Registry,
    preemption: preemption_lib.Preemption,
) -> tuple[TrainState, int, bool]:
    """Steps until train.steps, the end of finite data or a preemption: (the state, its step, preempted)."""
    while step < config.train.steps:
        batch = pipeline.next_batch(data_iterator, config.data.num_epochs > 0, config.model.vocab_size)
        if batch is None:
            _data_ended(config, step, state, host, step_hooks)
            break
        tokens_read = batch.pop('tokens_read').max(axis=0)  # rows count up; padding rows are 0
        state, step_metrics = group.train_step(state, group.device_batch(batch))
        step += 1
        step_hooks.poll()
        preempted, agreed = preemption.agree(step, config.train.log_every, **step_hooks.flags())
        record = hooks.StepRecord(step, step_metrics, state, tokens_read, step == config.train.steps, preempted, agreed)
        host.take(record)
        due = step_hooks.due(record)
        if due:
            host.settle()  # the NaN policy sees a step before it is saved or evaluated; its time is training's
        hooks_began = time.perf_counter()
        step_hooks.run(due, record)
        host.pause(time.perf_counter() - hooks_began)
        if preempted and not record.at_end:
            step_hooks.end(step, state)  # the saves in flight are durable
            tell_every_host(
                host.members,
                [f'preempted: saved step {step} in {m.path}; run the same command to resume' for m in host.members],
            )
            return state, step, True
    return state, step, False


def tell_every_host(members: list[hooks.Member], lines: list[str]) -> None:
    """A line per run (`lines`, in the order of `members`) on process 0's terminal and, headed by the
    process, on every other host's (whose log says nothing else, so that a host that is still working
    does not look hung)."""
    for m, line in zip(members, lines):
        if jax.process_index() == 0:
            m.writer.print(line)
        else:
            print(f'process {jax.process_index()} of {jax.process_count()}: {m.label}{line}', flush=True)


def _initial_state(trainer: TrainSteps, group: RunGroup, members: list[hooks.Member]) -> tuple[TrainState, int]:
    """The group's state to train on and its step; every member must start at the same step."""
    steps = [m.start.step() for m in members]
    if len(set(steps)) > 1:
        raise TrainingError(
            'runs trained together must start at the same step, but their checkpoints are at '
            + ', '.join(f'{m.path.name}: {m.start.step()}' for m in members)
            + '; train them apart.'
        )
    if all(m.start.state is None for m in members):
        return group.init_state([m.config.train.seed for m in members]), steps[0]
    # a checkpoint of step 0 beside a fresh member (train.steps=0): the fresh one's own init
    return group.stack(
        [trainer.init_state(m.config.train.seed) if m.start.state is None else m.start.state for m in members]
    ), steps[0]


def _announce(
    settled: plan.RunPlan,
    trainer: TrainSteps,
    group: RunGroup,
    members: list[hooks.Member],
    reads: dict[str, Any],
    request: start.Request,
    account: accounting.ModelAccount,
) -> None:
    """What the run reads (pipeline.provenance; a resume must read the same) recorded in config.json,
    and the start lines."""
    config, is_writer = settled.config, jax.process_index() == 0
    epoch_rates = pipeline.epochs_per_step(reads, config.data.batch_size * config.data.seq_len)
    opt, start_step = config.optimizer, members[0].start.step()
    together = f', trained with {group.members - 1} other seed(s) in one step' if group.members > 1 else ''
    for m in members:
        begun = m.start
        if begun.origin == start.Origin.RESUMED:
            multihost.on_process_0(lambda: _check_reads(m, reads, config.data.allow_data_change))
        if is_writer:
            changed = workdir_lib.record_start(
                m.path,
                m.config,
                start_step,
                request.fresh,
                {'params': account.params, 'non_embedding_params': account.non_embedding_params, 'data': reads},
                begun.source.record() if begun.source else {},
            )
            for name, (old, new) in changed.items():
                m.writer.print(f'{name} changed since the last start: {old!r} -> {new!r}')
        source = begun.source.record() if begun.source else {}
        m.writer.mark_start(start_step, begun.origin.value, group_size=group.members, **source)
        m.writer.print(
            f'{config.model.variant_name}: {account.params:,} params, mesh {dict(trainer.mesh.shape)}, '
            f'{opt.name} + {opt.schedule} (peak LR {opt.peak_lr:g}), {begun.describe()}{together}'
        )
        for name, d in reads['datasets'].items():
            m.writer.print(
                f'data {name}: {d["train_tokens"]:,} train tokens ({d["train_tokens_are"]}'
                f'{", pre-tokenized" if d["pretokenized"] else ", tokenized on the fly"}, shuffled '
                f'{d["shuffle"]}): an epoch every {1 / epoch_rates[name]:,.0f} steps'
            )
        m.writer.print(
            f'tokenizer {settled.tokenizer.path} ({settled.tokenizer.vocab_size:,} pieces); writing to {m.path}'
        )
        m.writer.print(f'MFU against {settled.peak}')
        for note in plan.idle_settings(config, reads['datasets']):
            m.writer.print(note)
        if not is_writer:
            tell_every_host(
                [m],
                [
                    f'{config.model.variant_name}, {begun.describe()}, to step {config.train.steps}; '
                    'process 0 prints the progress'
                ],
            )
        if note := optimizer.schedule_note(opt, config.train.steps):
            m.writer.print(note)
        if start_step >= config.train.steps and (config.train.steps or begun.origin == start.Origin.RESUMED):
            m.writer.print(f'nothing to train: the checkpoint is at step {start_step} = train.steps')
        elif m is members[0] and config.train.steps:  # train.steps=0 saves the initial weights, no step
            m.writer.print('compiling the train step ...')


def _check_reads(m: hooks.Member, reads: dict[str, Any], allowed: bool) -> None:
    """A resume reads what the run read before, or says what changed: refused (TrainingError) unless
    data.allow_data_change, and then logged."""
    saved = workdir_lib.last_read(m.path)
    changed = pipeline.provenance_changes(saved, reads) if saved else []
    if changed and not allowed:
        raise TrainingError(
            f'{m.label}{m.path} was trained on other data than this run reads: {"; ".join(changed)}. '
            'Resume with what it read, train a new --workdir from its weights (--init_from), or set '
            'data.allow_data_change=true to go on (config.json records what each start read).'
        )
    for line in changed:
        m.writer.print(f'resuming on changed data (data.allow_data_change=true): {line}')


def _save_initial(
    config: Config,
    state: TrainState,
    members: list[hooks.Member],
    checkpoints: hooks.Checkpoints,
    evaluation: hooks.Evaluation,
) -> None:
    """train.steps=0 (a conversion): the initial parameters saved as step 0, and evaluated."""
    checkpoints.save(0, state, force=True)
    if config.train.eval_batches:
        evaluation.evaluate(0, state)
    for m in members:
        m.writer.print(f'train.steps=0: saved the initial parameters as step 0 in {m.path}')


def _data_ended(
    config: Config, step: int, state: TrainState, host: host_metrics.HostMetrics, step_hooks: hooks.Registry
) -> None:
    """data.num_epochs passes ended before train.steps: the hooks due at the end run at the last step
    (it is saved, then scored by validation and the downstream tasks, unless they ran there), said."""
    host.settle()
    record = hooks.StepRecord.end_of_data(step, state)
    step_hooks.run(step_hooks.due(record), record)
    for m in host.members:
        m.writer.print(
            f'the data ended after step {step}: data.num_epochs={config.data.num_epochs} passes over '
            f'it are done, before train.steps={config.train.steps}; step {step} is saved and '
            'evaluated (raise data.num_epochs, or 0 to repeat it, to train on)'
        )
