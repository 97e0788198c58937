"""The training loop: data -> jitted step -> lagged metrics -> eval / checkpoint -> sample.

The host reads step n's metrics only after dispatching step n + 1, so the device never
waits on logging. SIGTERM (what Cloud TPU sends before preemption, seen at every step on every
host) and a first Ctrl-C finish the current step, save, wait for the save to be durable and
return normally (a second Ctrl-C aborts). Process 0 holds the workdir's lock for the whole run (vrl/train/workdir.py).

`run_group` trains runs that differ only in seed with one step over a run axis (vrl/train/step.py's
RunGroup), each in its own workdir with its own checkpoints, metrics and evals, as `run` would.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from vrl.core import multihost, sharding, storage
from vrl.core.config import Config
from vrl.core.errors import VrlError
from vrl.data import pipeline
from vrl.model import accounting, decode
from vrl.train import aot, checkpoint, diagnostics, metrics, optimizer, tracking
from vrl.train import workdir as workdir_lib
from vrl.train.step import RunGroup, Trainer, TrainState


class TrainingError(VrlError, RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message names the step."""


@dataclasses.dataclass
class RunResult:
    step: int
    losses: dict[int, float]  # every step this run executed
    eval_loss: float | None
    state: TrainState
    preempted: bool


class _Preemption:
    """SIGTERM (what Cloud TPU sends before preemption) and a first Ctrl-C: the run stops after a step,
    saved. With several processes, JAX's preemption service catches SIGTERM on any host and agrees,
    through the coordination service, on the step at which every host saves: checked at every step
    (a local read). A Ctrl-C, and the loop's own flags (a lost lease, a timed save due), are agreed
    every `every` steps (an all-gather)."""

    def __init__(self):
        self.requested = False
        self._service = multihost.preemption_service()
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in ((signal.SIGINT,) if self._service else (signal.SIGTERM, signal.SIGINT))}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # the second Ctrl-C aborts
        name = 'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'
        print(f'{name}: finishing this step, then saving and exiting'
              + (' (Ctrl-C again to abort without saving)' if signum == signal.SIGINT else ''), flush=True)
        self.requested = True

    def agree(self, step: int, every: int, **local: bool) -> tuple[bool, dict[str, bool]]:
        """(preempted, each of `local`'s flags: whether it holds on any process), the same on every
        process; with several, the flags are gathered every `every` steps and False between."""
        if jax.process_count() == 1:
            return self.requested, local
        from jax.experimental import multihost_utils
        noticed = self._service and multihost_utils.reached_preemption_sync_point(step)
        if noticed:
            print(f'a preemption notice (SIGTERM) reached this pod: every host saves step {step}, then exits',
                  flush=True)
        if step % every:
            return noticed, dict.fromkeys(local, False)
        agreed = np.any(multihost_utils.process_allgather(np.array([self.requested, *local.values()])), axis=0)
        return noticed or bool(agreed[0]), {name: bool(flag) for name, flag in zip(local, agreed[1:])}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass(frozen=True)
class Validation:
    """Per evaluation set (data.eval's, or the eval_split of data.name or of each dataset of
    data.mixture), named NAME, or NAME:SPLIT for another split: (nats per target token,
    bits per byte = summed token losses / ln 2 / UTF-8 bytes of the text they stand for)."""
    domains: dict[str, tuple[float, float]]

    @property
    def loss(self) -> float:
        """The unweighted mean over the validation sets (the paper's metric for SlimPajama's 7 domains)."""
        return float(np.mean([loss for loss, _ in self.domains.values()]))

    @property
    def bits_per_byte(self) -> float:
        return float(np.mean([bpb for _, bpb in self.domains.values()]))

    def record(self) -> dict[str, float]:
        record = {'eval_loss': self.loss, 'eval_perplexity': math.exp(min(self.loss, 50)),
                  'eval_bpb': self.bits_per_byte}
        if len(self.domains) > 1:
            for name, (loss, bpb) in self.domains.items():
                record |= {f'eval_loss/{name}': loss, f'eval_bpb/{name}': bpb}
        return record


def validate(trainer: Trainer, params: Any, config: Config, tokenizer) -> Validation:
    """train.eval_batches batches of each validation set."""
    return _validations(trainer, params, config, pipeline.EvalSets(config.data, tokenizer))[0]


def _validations(stepper: Trainer | RunGroup, params: Any, config: Config, sets: pipeline.EvalSets
                 ) -> list[Validation]:
    """One Validation per run: `params` are one Trainer's run's, or a RunGroup's (a leading run axis)."""
    domains: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, split in config.data.evaluated():
        loss_sum = tokens = n_bytes = np.zeros(1)
        for batch in sets.batches(config.train.eval_batches, jax.process_index(), jax.process_count(), name, split):
            out = jax.device_get(stepper.eval_step(params, stepper.device_batch(batch)))
            loss_sum, tokens, n_bytes = (loss_sum + out['loss_sum'], tokens + out['tokens'], n_bytes + out['bytes'])
        domains[name if split == config.data.eval_split else f'{name}:{split}'] = (loss_sum / np.maximum(tokens, 1.0), loss_sum / math.log(2) / np.maximum(n_bytes, 1.0))
    runs = len(next(iter(domains.values()))[0])
    return [Validation({name: (float(loss[i]), float(bpb[i])) for name, (loss, bpb) in domains.items()})
            for i in range(runs)]


def run(config: Config, workdir: str, fresh: bool = False, init_from: str | None = None,
        branch_from: str | None = None, take_over_lease: bool = False) -> RunResult:
    """Trains `config` in `workdir`, resuming from its latest intact checkpoint; `fresh` starts over,
    moving the old run aside (vrl/train/workdir.py). A workdir without a checkpoint starts from `init_from`'s
    parameters, or from `branch_from`'s whole state (a step folder of another run), or at random.
    WorkdirError if another run holds the workdir (`take_over_lease`: a workdir on a bucket is taken
    from a holder known to be gone, at once)."""
    if init_from and branch_from:
        raise TrainingError('--init_from and --branch_from both name a start: give one (--init_from: weights '
                            'only; --branch_from: the whole state of another run\'s step).')
    return run_group([config], [workdir], fresh, init_from, branch_from, take_over_lease)[0]


def group_key(config: Config) -> Config:
    """What runs trained together must share: everything but the init seed (train.seed)."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, seed=0))


def run_group(configs: list[Config], workdirs: list[str], fresh: bool = False, init_from: str | None = None,
              branch_from: str | None = None, take_over_lease: bool = False) -> list[RunResult]:
    """Trains runs that differ only in train.seed together (vrl/train/step.py's RunGroup: one compiled step
    over a run axis, one shared batch stream), each in its own workdir exactly as `run` would train it
    alone: its checkpoints, metrics, eval and config.json. Every member must resume from the same step
    (a fresh member: step 0). `init_from` and `branch_from` are for a run alone."""
    if len({group_key(c) for c in configs}) > 1:
        raise TrainingError('runs trained together must differ only in train.seed; train the others apart.')
    if len(configs) > 1 and (init_from or branch_from):
        raise TrainingError('--init_from / --branch_from start one run; train it alone.')
    paths = [storage.path(w) for w in workdirs]  # local ones absolute, as Orbax needs
    locks = [workdir_lib.hold(path, 'run', c.train.lease_stale_seconds, take_over_lease)
             for path, c in zip(paths, configs)]
    preemption = _Preemption()  # from here on, a signal during setup or the first compile saves too
    try:  # process 0 writes the runs' shared files; every process stops if it cannot
        multihost.on_process_0(lambda: [workdir_lib.claim(lock) for lock in locks])
        return _run(configs, paths, locks, fresh, init_from, branch_from, preemption)
    finally:
        preemption.restore()
        for lock in locks:
            workdir_lib.let_go(lock)


def _initial_params(init_from: str, trainer: Trainer, config: Config) -> tuple[Any, str]:
    """--init_from: another run's checkpoint (any model whose shapes match), or `hf:DIR`, a Hugging
    Face Llama directory (vrl/interop/hf.py), placed in the training layout; and what to log about it."""
    if not init_from.startswith('hf:'):
        return checkpoint.restore_params(init_from, trainer.abstract_state.params), ''
    from vrl.interop import hf  # safetensors: requirements-extra.txt
    shapes = jax.tree.map(lambda a: a.shape, trainer.abstract_state.params)
    imported = hf.load_params(_hf_dir(init_from), config.model, shapes)
    note = f' ({imported.tensors} tensors), tokenizer {config.data.tokenizer}'
    return jax.device_put(imported.params, trainer.param_shardings), note + (f'; {imported.note}' if imported.note else '')


def _hf_dir(init_from: str) -> str:
    """The folder of --init_from=hf:DIR, local (a DIR on an object store is copied down once)."""
    folder = storage.path(init_from.removeprefix('hf:'))
    if storage.is_remote(folder) and not storage.exists(folder / 'config.json', '--init_from'):
        raise TrainingError(f'--init_from={init_from}: no config.json in {folder}; hf:DIR needs a Hugging Face '
                            'model directory (config.json + *.safetensors).')
    return str(storage.local_copy(folder))


def _hf_tokenizer(config: Config, init_from: str | None, path: epath.Path) -> tuple[Config, epath.Path | None, str]:
    """A run started from hf:DIR trains with the tokenizer its weights came with (vrl/interop/hf.py's
    `run_tokenizer`), kept in the workdir under its file's name so that the run's tools find it after
    DIR is gone: (the config naming it, the file to copy there or None, how it was chosen)."""
    if not (init_from and init_from.startswith('hf:')):
        return config, None, ''
    from vrl.interop import hf  # safetensors: requirements-extra.txt
    chosen, line = hf.run_tokenizer(_hf_dir(init_from), config.data.tokenizer)
    if config.data.tokenizer:
        return config, None, line
    kept = path / epath.Path(chosen).name
    return dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(kept))), epath.Path(chosen), line


class _Member:
    """One run of a group, host side: its workdir and the guard that keeps it (process 0's), checkpoints,
    metrics, NaN policy and losses."""

    def __init__(self, config: Config, path: epath.Path, guard: workdir_lib.Lock | workdir_lib.Lease, label: str,
                 is_writer: bool):
        self.config, self.path, self.guard, self.label = config, path, guard, label
        self.manager = checkpoint.make_manager(str(path), config)
        self.writer: metrics.MetricsWriter | None = None
        self.say = (lambda line: print(label + line, flush=True)) if is_writer else (lambda line: None)
        self.losses: dict[int, float] = {}
        self.eval_loss: float | None = None
        self.skipped_in_a_row = self.skipped = 0

    def check_finite(self, step: int, finite: bool) -> None:
        """train.nan_policy for one step: stop ('error', or too many skipped) or count the skip."""
        train_cfg = self.config.train
        if finite:
            self.skipped_in_a_row = 0
            return
        if train_cfg.nan_policy == 'error':
            raise TrainingError(f'{self.label}non-finite loss, gradients or weights at step {step}; no checkpoint '
                                f'of it was written (latest saved: '
                                f'{self.manager.latest_step()}). Lower the LR or set train.nan_policy=skip.')
        self.skipped_in_a_row += 1
        self.skipped += 1
        if self.skipped_in_a_row > train_cfg.max_skipped_steps:
            raise TrainingError(f'{self.label}{self.skipped_in_a_row} steps in a row up to step {step} were '
                                f'non-finite and skipped (train.max_skipped_steps={train_cfg.max_skipped_steps}): '
                                'the run is not learning; lower the LR.')
        logging.warning('%sstep %d: non-finite loss, gradients or weights; update skipped', self.label, step)


def _run(configs: list[Config], paths: list[epath.Path], guards: list[workdir_lib.Lock | workdir_lib.Lease],
         fresh: bool, init_from: str | None, branch_from: str | None, preemption: _Preemption) -> list[RunResult]:
    is_writer = jax.process_index() == 0
    say = print if is_writer else (lambda line: None)
    mesh = sharding.make_mesh(configs[0].mesh)
    sharding.check_fits_mesh(configs[0], mesh.devices.shape)
    config, tokenizer_source, tokenizer_line = _hf_tokenizer(configs[0], init_from, paths[0])
    # the data before anything compiles (auto-fit compiles for minutes): the workdir's copy of an
    # hf: tokenizer is made further down, so its source stands in for it here
    data_cfg = config.data if tokenizer_source is None else dataclasses.replace(config.data, tokenizer=str(tokenizer_source))
    tokenizer = multihost.process_0_first(lambda: pipeline.ready(data_cfg, config.model.vocab_size))
    dataset = pipeline.train_dataset(data_cfg, tokenizer, jax.process_index(), jax.process_count())
    config, _ = aot.resolve(config, list(mesh.devices.flat), aot.local_hbm_bytes(), say)
    trainer = Trainer(config, mesh)
    group = trainer.group(len(configs))
    labels = [f'[{path.name}] ' if group.members > 1 else '' for path in paths]
    member_configs = [dataclasses.replace(config, train=dataclasses.replace(config.train, seed=c.train.seed))
                      for c in configs]
    _confirm(guards)  # the compile may have taken long
    if fresh and is_writer:
        for path, label, member_config in zip(paths, labels, member_configs):
            say(label + workdir_lib.start_over(path, member_config, checkpoint.latest_step(path)))
    if tokenizer_source and is_writer:
        say(workdir_lib.keep_tokenizer(paths[0], tokenizer_source, tokenizer_line))
    multihost.sync('vrl workdir ready')
    members = [_Member(*member, is_writer) for member in zip(member_configs, paths, guards, labels)]
    data_iterator = iter(dataset)
    try:
        return _train(trainer, group, members, tokenizer, data_iterator, init_from, branch_from, fresh, preemption)
    finally:
        if not any(m.guard.lost for m in members):  # else another run holds a workdir: add nothing there
            try:
                for m in members:
                    checkpoint.check_saves(m.manager, wait=True)
            finally:
                for m in members:
                    checkpoint.close(m.manager)
                    if m.writer is not None:
                        m.writer.close()
        getattr(data_iterator, 'close', lambda: None)()


def _start(trainer: Trainer, m: _Member, data_iterator: Any, init_from: str | None, branch_from: str | None
           ) -> tuple[TrainState | None, str]:
    """The member's state to start from (its checkpoint, a branch, weights from elsewhere; None: a
    fresh init, made for the whole group at once) and how it begins."""
    config = m.config
    checkpoint.check_committed(m.path)
    latest = m.manager.latest_step()
    if latest is not None and latest > config.train.steps:
        raise TrainingError(f'train.steps={config.train.steps} is below the step of the checkpoint in {m.path} '
                            f'({latest}): raise train.steps to go on, or use --fresh to start over.')
    restored = checkpoint.restore_latest(m.manager, trainer.abstract_state, data_iterator, config, m.say)
    if restored is not None:
        if init_from or branch_from:
            flag = '--init_from' if init_from else '--branch_from'
            m.say(f'{flag} ignored: the workdir has a checkpoint, so this run resumes from step {restored[1]} '
                  f'(use --fresh to start over from {flag})')
        return restored[0], 'resumed'
    if branch_from:
        state, branched = checkpoint.restore_branch(branch_from, trainer.abstract_state, data_iterator, config)
        m.say(f'branched from {branch_from}: its step-{branched} parameters, optimizer state and data position')
        return state, 'branched'
    if not init_from:
        return None, 'started'
    params, note = _initial_params(init_from, trainer, config)
    m.say(f'initialised from {init_from}{note}')
    return trainer.init_state(config.train.seed)._replace(params=params), 'started'


def _confirm(guards: list[workdir_lib.Lock | workdir_lib.Lease]) -> None:
    """Every process stops (LeaseLostError, one line) unless process 0 surely still holds each workdir."""
    multihost.on_process_0(lambda: [guard.confirm() for guard in guards])


def _check_reads(m: _Member, reads: dict[str, Any], allowed: bool) -> None:
    """A resume reads what the run read before, or says what changed: refused (TrainingError) unless
    data.allow_data_change, and then logged."""
    saved = workdir_lib.last_read(m.path)
    changed = pipeline.provenance_changes(saved, reads) if saved else []
    if changed and not allowed:
        raise TrainingError(f'{m.label}{m.path} was trained on other data than this run reads: {"; ".join(changed)}. '
                            'Resume with what it read, train a new --workdir from its weights (--init_from), or set '
                            'data.allow_data_change=true to go on (config.json records what each start read).')
    for line in changed:
        m.say(f'resuming on changed data (data.allow_data_change=true): {line}')


def _train(trainer: Trainer, group: RunGroup, members: list[_Member], tokenizer, data_iterator: Any,
           init_from: str | None, branch_from: str | None, fresh: bool, preemption: _Preemption
           ) -> list[RunResult]:
    config, mesh = trainer.config, trainer.mesh
    is_writer = jax.process_index() == 0
    starts = [_start(trainer, m, data_iterator, init_from, branch_from) for m in members]
    start_steps = [0 if state is None else int(state.step) for state, _ in starts]
    if len(set(start_steps)) > 1:
        raise TrainingError('runs trained together must start at the same step, but their checkpoints are at '
                            + ', '.join(f'{m.path.name}: {s}' for m, s in zip(members, start_steps))
                            + '; train them apart.')
    if all(state is None for state, _ in starts):
        state = group.init_state([m.config.train.seed for m in members])
    else:  # a checkpoint of step 0 beside a fresh member (train.steps=0): the fresh one's own init
        state = group.stack([trainer.init_state(m.config.train.seed) if s is None else s
                             for m, (s, _) in zip(members, starts)])
    start_step = step = start_steps[0]

    account = accounting.account(config.model, config.data.seq_len)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    peak = metrics.peak_flops_per_device(config.train.peak_flops, config.model.compute_dtype) * jax.device_count()
    opt = config.optimizer
    together = f', trained with {group.members - 1} other seed(s) in one step' if group.members > 1 else ''
    def confirm_leases() -> None:
        _confirm([m.guard for m in members])

    confirm_leases()
    reads = {'data': pipeline.provenance(config.data, tokenizer)}
    epoch_rates = pipeline.epochs_per_step(reads['data'], tokens_per_step)
    for m, (_, how) in zip(members, starts):
        if how == 'resumed':
            multihost.on_process_0(lambda: _check_reads(m, reads['data'], config.data.allow_data_change))
        if is_writer:
            changed = workdir_lib.record_start(m.path, m.config, start_step, fresh, {
                'params': account.params, 'non_embedding_params': account.non_embedding_params, **reads})
            for name, (old, new) in changed.items():
                m.say(f'{name} changed since the last start: {old!r} -> {new!r}')
        tracker = tracking.WandbRun(m.config, m.path, reads) if is_writer and config.train.wandb_project else None
        m.writer = metrics.MetricsWriter(str(m.path), config.train.steps, start_step, is_writer, m.label, tracker,
                                         m.guard)
        m.writer.mark_start(start_step, 'resumed' if how == 'resumed' else 'started', init_from=init_from)
        begun = {'resumed': f'resumed at step {start_step}', 'branched': f'branched at step {start_step}',
                 'started': 'fresh start'}[how]
        m.writer.print(f'{config.model.variant_name}: {account.params:,} params, mesh {dict(mesh.shape)}, '
                       f'{opt.name} + {opt.schedule} (peak LR {opt.peak_lr:g}), {begun}{together}')
        for name, d in reads['data']['datasets'].items():
            m.writer.print(f'data {name}: {d["train_tokens"]:,} train tokens ({d["train_tokens_are"]}'
                           f'{", pre-tokenized" if d["pretokenized"] else ", tokenized on the fly"}): an epoch '
                           f'every {1 / epoch_rates[name]:,.0f} steps')
        m.writer.print(f'tokenizer {tokenizer.path} ({tokenizer.vocab_size:,} pieces); writing to {m.path}')
        if note := optimizer.schedule_note(opt, config.train.steps):
            m.writer.print(note)
        if start_step >= config.train.steps and (config.train.steps or how == 'resumed'):
            m.writer.print(f'nothing to train: the checkpoint is at step {start_step} = train.steps')
    resumed = starts[0][1] == 'resumed'

    pending: tuple[int, dict, np.ndarray] | None = None
    interval_start, interval_steps = time.perf_counter(), 0
    train_tokens = {name: d['train_tokens'] for name, d in reads['data']['datasets'].items()}

    def read(step: int, step_metrics: dict, tokens_read: np.ndarray) -> None:
        """Host side of step `step` for every member: NaN policy, loss record, periodic log line
        (with the target tokens read from each dataset up to the step, on every process)."""
        nonlocal interval_start, interval_steps
        host = jax.device_get(step_metrics)
        interval_steps += 1
        logging_now = step % config.train.log_every == 0 or step == config.train.steps
        elapsed = time.perf_counter() - interval_start
        if logging_now:
            read_so_far = dict(zip(train_tokens, multihost.summed(tokens_read).tolist()))
            data_record = {**{f'tokens/{name}': n for name, n in read_so_far.items()},
                           **{f'epoch/{name}': n / max(train_tokens[name], 1) for name, n in read_so_far.items()}}
        for i, m in enumerate(members):
            mine = group.member(host, i)
            m.check_finite(step, bool(mine['finite']))
            m.losses[step] = float(mine['loss'])
            if logging_now:
                tokens_per_sec = interval_steps * tokens_per_step / elapsed
                m.writer.write(step, {'loss': mine['loss'], 'lr': mine['lr'], 'grad_norm': mine['grad_norm'],
                                      'tokens_per_sec': tokens_per_sec, 'step_time': elapsed / interval_steps,
                                      'mfu': account.flops_per_token * tokens_per_sec / peak, **data_record})
        if logging_now:
            interval_start, interval_steps = time.perf_counter(), 0

    minutes, saved_at = config.train.checkpoint_minutes, [time.monotonic()]  # train.checkpoint_minutes' clock

    def save(step: int, force: bool) -> None:
        confirm_leases()
        saved_at[0] = time.monotonic()
        for i, m in enumerate(members):
            m.writer.flush(wait=True)  # on an object store, every step's metrics are there before its checkpoint
            checkpoint.save(m.manager, step, group.member(state, i), data_iterator, m.config, force=force)

    eval_sets = pipeline.EvalSets(config.data, tokenizer)  # opened at the first evaluation, then kept

    def evaluate(step: int) -> None:
        for m, evaluation in zip(members, _validations(group, state.params, config, eval_sets)):
            m.eval_loss = evaluation.loss
            m.writer.write(step, evaluation.record())
            m.writer.flush()

    every = config.train.diagnostics_every
    diagnose = diagnostics.TrainingDiagnostics(trainer, tokenizer) if every and every <= config.train.steps else None

    def record_diagnostics(step: int) -> None:
        for i, m in enumerate(members):
            m.writer.write_diagnostics(step, diagnose(group.member(state.params, i)))

    def data_ended(step: int, saved: bool) -> None:
        """data.num_epochs passes ended before train.steps: the last step saved and evaluated, said."""
        nonlocal pending
        if pending is not None:
            read(*pending)
            pending = None
        if not saved:
            save(step, force=True)
        evaluate(step)
        for m in members:
            m.writer.print(f'the data ended after step {step}: data.num_epochs={config.data.num_epochs} passes over '
                           f'it are done, before train.steps={config.train.steps}; step {step} is saved and '
                           'evaluated (raise data.num_epochs, or 0 to repeat it, to train on)')

    def results(preempted: bool) -> list[RunResult]:
        return [RunResult(step, m.losses, m.eval_loss, group.member(state, i), preempted)
                for i, m in enumerate(members)]

    if config.train.steps == 0 and not resumed:  # a conversion: the initial parameters as step 0
        save(0, force=True)
        if config.train.eval_batches:
            evaluate(0)
        for m in members:
            m.writer.print(f'train.steps=0: saved the initial parameters as step 0 in {m.path}')
    while step < config.train.steps:
        host_batch = pipeline.next_batch(data_iterator, finite=config.data.num_epochs > 0)
        if host_batch is None:
            data_ended(step, saved=step == start_step or step % config.train.checkpoint_every == 0)
            break
        tokens_read = host_batch.pop('tokens_read').max(axis=0)  # rows count up; padding rows are 0
        state, step_metrics = group.train_step(state, group.device_batch(host_batch))
        step += 1
        for m in members:
            checkpoint.check_saves(m.manager)  # a failed async save stops the run at the next step
        if pending is not None:
            read(*pending)
        pending = (step, step_metrics, tokens_read)
        preempted, due = preemption.agree(
            step, config.train.log_every, lease_lost=any(m.guard.lost for m in members),
            timed_save=bool(minutes) and time.monotonic() - saved_at[0] >= 60 * minutes)
        if due['lease_lost']:
            confirm_leases()
        at_end = step == config.train.steps
        stable_end = config.optimizer.schedule == 'wsd' and step == config.optimizer.decay_start  # to extend from
        saving = step % config.train.checkpoint_every == 0 or preempted or at_end or stable_end or due['timed_save']
        evaluating = bool(config.train.eval_every and step % config.train.eval_every == 0) or at_end
        if saving or evaluating:
            read(*pending)  # the NaN policy sees a step before it is saved or evaluated
            pending = None
        if saving:
            save(step, force=preempted or at_end)
        if evaluating:
            evaluate(step)
        if diagnose and step % every == 0:
            record_diagnostics(step)
        if preempted and not at_end:
            for m in members:
                checkpoint.check_saves(m.manager, wait=True)
                m.writer.print(f'preempted: saved step {step}; run the same command to resume')
            return results(preempted=True)
    if pending is not None:
        read(*pending)
    for m in members:
        checkpoint.check_saves(m.manager, wait=True)
        if 2 * m.skipped > step - start_step:
            raise TrainingError(f'{m.label}{m.skipped} of the {step - start_step} steps this run took were '
                                'non-finite and skipped (train.nan_policy=skip): the run is not learning; lower '
                                f'the LR. The checkpoint of step {step} holds the weights of the last finite step.')
    if config.train.sample_tokens and step > start_step:
        text = config.train.sample_prompt or pipeline.opening_words(config.data, tokenizer)
        prompt = pipeline.prompt_tokens(config.data, tokenizer, text)
        sampling = decode.Sampling(max_new_tokens=min(config.train.sample_tokens, config.data.seq_len - len(prompt)))
        for i, m in enumerate(members):
            generator = decode.Generator(config.model, trainer.graphdef, group.member(state.params, i),
                                         config.data.seq_len, tokenizer.eos_id, mesh)
            completion = generator.generate([prompt], sampling).tokens[0]
            m.writer.print(f'sample (greedy): {text}{tokenizer.decode(completion)}')
    return results(preempted=False)
