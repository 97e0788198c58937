"""The training loop: data -> jitted step -> lagged metrics -> eval / checkpoint -> sample.

The host reads step n's metrics only after dispatching step n + 1, so the device never
waits on logging. SIGTERM (what Cloud TPU sends before preemption) and a first Ctrl-C finish
the current step, save, wait for the save to be durable and return normally (a second Ctrl-C
aborts). Process 0 holds the workdir's lock for the whole run (vrl/workdir.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from vrl import accounting, aot, checkpoint, data, decode, metrics, resolve, sharding
from vrl import workdir as workdir_lib
from vrl.config import Config
from vrl.errors import VrlError
from vrl.step import Trainer, TrainState


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
    """Turns SIGTERM and the first Ctrl-C into a flag the loop checks after each step."""

    def __init__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # the second Ctrl-C aborts
        name = 'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'
        print(f'{name}: finishing this step, then saving and exiting'
              + (' (Ctrl-C again to abort without saving)' if signum == signal.SIGINT else ''), flush=True)
        self.requested = True

    def reached(self, step: int, every: int) -> bool:
        """With several processes, all hosts agree every `every` steps (an all-gather of one flag)."""
        if jax.process_count() == 1:
            return self.requested
        if step % every:
            return False
        from jax.experimental import multihost_utils
        return bool(np.any(multihost_utils.process_allgather(np.array(self.requested))))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _check_workdir(workdir: str) -> Path:
    """The workdir as an absolute path (Orbax needs one), created and known to be writable."""
    path = Path(workdir).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f'.vrl_write_test.{os.getpid()}'
        probe.write_text('ok')
        probe.unlink()
    except OSError as e:
        raise TrainingError(f'cannot write to workdir {workdir!r} ({e.strerror}); choose a writable '
                            '--workdir.') from e
    return path


@dataclasses.dataclass(frozen=True)
class Validation:
    """Per validation set (data.name, or each dataset of data.mixture): (nats per target token,
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
    domains = {}
    for name, _ in config.data.sources():
        loss_sum = tokens = n_bytes = 0.0
        for batch in data.eval_batches(config.data, tokenizer, config.train.eval_batches,
                                       jax.process_index(), jax.process_count(), name=name):
            batch['target_bytes'] = tokenizer.utf8_bytes[batch['targets']]
            out = trainer.eval_step(params, trainer.device_batch(batch))
            loss_sum, tokens, n_bytes = (loss_sum + float(out['loss_sum']), tokens + float(out['tokens']),
                                         n_bytes + float(out['bytes']))
        domains[name] = (loss_sum / max(tokens, 1.0), loss_sum / math.log(2) / max(n_bytes, 1.0))
    return Validation(domains)


def _sync(name: str) -> None:
    """All processes wait here (process 0 may have changed the workdir)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def run(config: Config, workdir: str, fresh: bool = False, init_from: str | None = None,
        branch_from: str | None = None) -> RunResult:
    """Trains `config` in `workdir`, resuming from its latest intact checkpoint; `fresh` starts over,
    moving the old run aside (vrl/workdir.py). A workdir without a checkpoint starts from `init_from`'s
    parameters, or from `branch_from`'s whole state (a step folder of another run), or at random.
    WorkdirError if another run holds the workdir."""
    if init_from and branch_from:
        raise TrainingError('--init_from and --branch_from both name a start: give one (--init_from: weights '
                            'only; --branch_from: the whole state of another run\'s step).')
    path = _check_workdir(workdir)
    lock = workdir_lib.Lock(path)
    if jax.process_index() == 0:
        lock.acquire()
    preemption = _Preemption()  # from here on, a signal during setup or the first compile saves too
    try:
        return _run(config, path, fresh, init_from, branch_from, preemption)
    finally:
        preemption.restore()
        lock.release()


def _initial_params(init_from: str, trainer: Trainer, config: Config) -> tuple[Any, str]:
    """--init_from: another run's checkpoint (any model whose shapes match), or `hf:DIR`, a Hugging
    Face Llama directory (vrl/hf.py), placed in the training layout; and what to log about it."""
    if not init_from.startswith('hf:'):
        return checkpoint.restore_params(init_from, trainer.abstract_state.params), ''
    from vrl import hf  # safetensors: requirements-extra.txt
    shapes = jax.tree.map(lambda a: a.shape, trainer.abstract_state.params)
    imported = hf.load_params(init_from[3:], config.model, shapes)
    note = f' ({imported.tensors} tensors), tokenizer {config.data.tokenizer}'
    return jax.device_put(imported.params, trainer.param_shardings), note + (f'; {imported.note}' if imported.note else '')


def _hf_tokenizer(config: Config, init_from: str | None, path: Path) -> tuple[Config, Path | None, str]:
    """A run started from hf:DIR trains with the tokenizer its weights came with (vrl/hf.py's
    `run_tokenizer`), kept in the workdir as tokenizer.model so that the run's tools find it after
    DIR is gone: (the config naming it, the file to copy there or None, how it was chosen)."""
    if not (init_from and init_from.startswith('hf:')):
        return config, None, ''
    from vrl import hf  # safetensors: requirements-extra.txt
    chosen, line = hf.run_tokenizer(init_from[3:], config.data.tokenizer)
    if config.data.tokenizer:
        return config, None, line
    kept = path / workdir_lib.TOKENIZER
    return dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=str(kept))), Path(chosen), line


def _run(config: Config, path: Path, fresh: bool, init_from: str | None, branch_from: str | None,
         preemption: _Preemption) -> RunResult:
    is_writer = jax.process_index() == 0
    say = print if is_writer else (lambda line: None)
    workdir = str(path)
    mesh = sharding.make_mesh(config.mesh)
    sharding.check_fits_mesh(config, mesh.devices.shape)
    config, _ = resolve.resolve(config, list(mesh.devices.flat), aot.local_hbm_bytes(), say)
    config, tokenizer_source, tokenizer_line = _hf_tokenizer(config, init_from, path)
    trainer = Trainer(config, mesh)
    if fresh and is_writer:
        say(workdir_lib.start_over(path, config, checkpoint.latest_step(path)))
    if tokenizer_source and is_writer:
        say(workdir_lib.keep_tokenizer(path, tokenizer_source, tokenizer_line))
    _sync('vrl workdir ready')
    tokenizer = data.load_tokenizer(config.data, config.model.vocab_size)
    manager = checkpoint.make_manager(workdir, config.train)
    data_iterator = iter(data.train_dataset(config.data, tokenizer, jax.process_index(), jax.process_count()))

    latest = manager.latest_step()
    if latest is not None and latest > config.train.steps:
        raise TrainingError(f'train.steps={config.train.steps} is below the step of the checkpoint in {workdir} '
                            f'({latest}): raise train.steps to go on, or use --fresh to start over.')
    restored = checkpoint.restore_latest(manager, trainer.abstract_state, data_iterator, config, say)
    if restored is not None:
        state, latest = restored
        if init_from or branch_from:
            flag = '--init_from' if init_from else '--branch_from'
            say(f'{flag} ignored: the workdir has a checkpoint, so this run resumes from step {latest} '
                f'(use --fresh to start over from {flag})')
    elif branch_from:
        state, branched = checkpoint.restore_branch(branch_from, trainer.abstract_state, data_iterator, config)
        say(f'branched from {branch_from}: its step-{branched} parameters, optimizer state and data position')
    else:
        state = trainer.init_state(config.train.seed)
        if init_from:
            params, note = _initial_params(init_from, trainer, config)
            state = state._replace(params=params)
            say(f'initialised from {init_from}{note}')
    start_step = int(state.step)

    account = accounting.account(config.model, config.data.seq_len)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    peak = metrics.peak_flops_per_device(config.train.peak_flops, config.model.compute_dtype) * jax.device_count()
    if is_writer:
        changed = workdir_lib.record_start(path, config, start_step, fresh, {
            'params': account.params, 'non_embedding_params': account.non_embedding_params})
        for name, (old, new) in changed.items():
            say(f'{name} changed since the last start: {old!r} -> {new!r}')
    writer = metrics.MetricsWriter(workdir, config.train.steps, start_step, enabled=is_writer)
    writer.mark_start(start_step, 'resumed' if restored is not None else 'started', init_from=init_from)
    opt = config.optimizer
    begun = ('resumed at step ' + str(start_step) if restored is not None else
             f'branched at step {start_step}' if branch_from else 'fresh start')
    writer.print(f'{config.model.variant_name}: {account.params:,} params, mesh {dict(mesh.shape)}, '
                 f'{opt.name} + {opt.schedule} (peak LR {opt.peak_lr:g}), {begun}')
    if start_step >= config.train.steps and (config.train.steps or restored is not None):
        writer.print(f'nothing to train: the checkpoint is at step {start_step} = train.steps')

    losses: dict[int, float] = {}
    eval_loss = None
    pending: tuple[int, dict] | None = None
    interval_start, interval_steps = time.perf_counter(), 0
    skipped_in_a_row = skipped = 0

    def read(step: int, step_metrics: dict) -> None:
        """Host side of step `step`: NaN policy, loss record, periodic log line."""
        nonlocal interval_start, interval_steps, skipped_in_a_row, skipped
        host = jax.device_get(step_metrics)
        if not host['finite']:
            if config.train.nan_policy == 'error':
                raise TrainingError(f'non-finite loss, gradients or weights at step {step}; no checkpoint '
                                    f'of it was written (latest saved: '
                                    f'{manager.latest_step()}). Lower the LR or set train.nan_policy=skip.')
            skipped_in_a_row += 1
            skipped += 1
            if skipped_in_a_row > config.train.max_skipped_steps:
                raise TrainingError(f'{skipped_in_a_row} steps in a row up to step {step} were non-finite and '
                                    f'skipped (train.max_skipped_steps={config.train.max_skipped_steps}): the '
                                    'run is not learning; lower the LR.')
            logging.warning('step %d: non-finite loss, gradients or weights; update skipped', step)
        else:
            skipped_in_a_row = 0
        losses[step] = float(host['loss'])
        interval_steps += 1
        if step % config.train.log_every == 0 or step == config.train.steps:
            elapsed = time.perf_counter() - interval_start
            tokens_per_sec = interval_steps * tokens_per_step / elapsed
            writer.write(step, {'loss': host['loss'], 'lr': host['lr'], 'grad_norm': host['grad_norm'],
                                'tokens_per_sec': tokens_per_sec, 'step_time': elapsed / interval_steps,
                                'mfu': account.flops_per_token * tokens_per_sec / peak})
            interval_start, interval_steps = time.perf_counter(), 0

    step = start_step
    try:
        if config.train.steps == 0 and restored is None:  # a conversion: the initial parameters as step 0
            checkpoint.save(manager, 0, state, data_iterator, config, force=True)
            if config.train.eval_batches:
                evaluation = validate(trainer, state.params, config, tokenizer)
                eval_loss = evaluation.loss
                writer.write(0, evaluation.record())
            writer.print(f'train.steps=0: saved the initial parameters as step 0 in {workdir}')
        while step < config.train.steps:
            batch = trainer.device_batch(next(data_iterator))
            state, step_metrics = trainer.train_step(state, batch)
            step += 1
            checkpoint.check_saves(manager)  # a failed async save stops the run at the next step
            if pending is not None:
                read(*pending)
            pending = (step, step_metrics)
            preempted = preemption.reached(step, config.train.log_every)
            at_end = step == config.train.steps
            stable_end = config.optimizer.schedule == 'wsd' and step == config.optimizer.decay_start  # to extend from
            saving = step % config.train.checkpoint_every == 0 or preempted or at_end or stable_end
            evaluating = bool(config.train.eval_every and step % config.train.eval_every == 0) or at_end
            if saving or evaluating:
                read(*pending)  # the NaN policy sees a step before it is saved or evaluated
                pending = None
            if saving:
                checkpoint.save(manager, step, state, data_iterator, config, force=preempted or at_end)
            if evaluating:
                evaluation = validate(trainer, state.params, config, tokenizer)
                eval_loss = evaluation.loss
                writer.write(step, evaluation.record())
            if preempted and not at_end:
                checkpoint.check_saves(manager, wait=True)
                writer.print(f'preempted: saved step {step}; run the same command to resume')
                return RunResult(step, losses, eval_loss, state, preempted=True)
        if pending is not None:
            read(*pending)
        checkpoint.check_saves(manager, wait=True)
        if 2 * skipped > step - start_step:
            raise TrainingError(f'{skipped} of the {step - start_step} steps this run took were non-finite and skipped '
                                '(train.nan_policy=skip): the run is not learning; lower the LR. The checkpoint of '
                                f'step {step} holds the weights of the last finite step.')
        if config.train.sample_prompt and config.train.sample_tokens and step > start_step:
            generator = decode.Generator(config.model, trainer.graphdef, state.params, config.data.seq_len,
                                         tokenizer.eos_id, trainer.mesh)
            prompt = data.prompt_tokens(config.data, tokenizer, config.train.sample_prompt)
            sampling = decode.Sampling(max_new_tokens=min(config.train.sample_tokens, config.data.seq_len - len(prompt)))
            completion = generator.generate([prompt], sampling).tokens[0]
            writer.print(f'sample (greedy): {config.train.sample_prompt}{tokenizer.decode(completion)}')
        return RunResult(step, losses, eval_loss, state, preempted=False)
    finally:
        try:
            checkpoint.check_saves(manager, wait=True)
        finally:
            checkpoint.close(manager)
            writer.close()
        getattr(data_iterator, 'close', lambda: None)()
