"""The training loop: data -> jitted step -> lagged metrics -> eval / checkpoint -> sample.

The host reads step n's metrics only after dispatching step n + 1, so the device never
waits on logging. SIGTERM (what Cloud TPU sends before preemption) finishes the current
step, saves, waits for the save to be durable and returns normally.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from vrl import accounting, checkpoint, data, decode, metrics, sharding
from vrl.config import Config, from_configdict
from vrl.step import TrainState, Trainer
from vrl.tokenizer import Tokenizer


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message names the step."""


@dataclasses.dataclass
class RunResult:
    step: int
    losses: dict[int, float]  # every step this run executed
    eval_loss: float | None
    state: TrainState
    preempted: bool


class _Preemption:
    """Turns SIGTERM into a flag the loop checks after each step."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        logging.warning('SIGTERM: finishing this step, then saving and exiting')
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
        signal.signal(signal.SIGTERM, self._previous)


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


def load_run(workdir: str) -> tuple[Config, Tokenizer]:
    """The config a workdir was trained with (its config.json) and the run's tokenizer."""
    config_file = Path(workdir) / 'config.json'
    if not config_file.exists():
        raise FileNotFoundError(f'{config_file} not found: --workdir must be a directory that '
                                '`python -m vrl.main --workdir=...` trained in.')
    config = from_configdict(ml_collections.ConfigDict(json.loads(config_file.read_text())['config']))
    return config, data.load_tokenizer(config.data, config.model.vocab_size)


def evaluate(trainer: Trainer, params: Any, config: Config, tokenizer) -> float:
    loss_sum = tokens = 0.0
    for batch in data.eval_batches(config.data, tokenizer, config.train.eval_batches,
                                   jax.process_index(), jax.process_count()):
        out = trainer.eval_step(params, trainer.device_batch(batch))
        loss_sum, tokens = loss_sum + float(out['loss_sum']), tokens + float(out['tokens'])
    return loss_sum / max(tokens, 1.0)


def run(config: Config, workdir: str, fresh: bool = False, init_from: str | None = None) -> RunResult:
    """Trains `config` in `workdir`, resuming from its latest checkpoint unless `fresh`."""
    is_writer = jax.process_index() == 0
    path = _check_workdir(workdir)
    workdir = str(path)
    mesh = sharding.make_mesh(config.mesh)
    sharding.check_model_fits_mesh(config.model, mesh.devices.shape)
    tokenizer = data.load_tokenizer(config.data, config.model.vocab_size)
    trainer = Trainer(config, mesh)
    manager = checkpoint.make_manager(workdir, config.train)
    data_iterator = iter(data.train_dataset(config.data, tokenizer, jax.process_index(), jax.process_count()))

    latest = None if fresh else manager.latest_step()
    if latest is not None:
        state = checkpoint.restore(manager, latest, trainer.abstract_state, data_iterator)
    else:
        state = trainer.init_state(config.train.seed)
        if init_from:
            state = state._replace(params=checkpoint.restore_params(init_from, trainer.abstract_state.params))
    start_step = int(state.step)

    account = accounting.account(config.model, config.data.seq_len)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    peak = metrics.peak_flops_per_device(config.train.peak_flops) * jax.device_count()
    if is_writer:
        (path / 'config.json').write_text(json.dumps(
            {'config': dataclasses.asdict(config), 'params': account.params,
             'non_embedding_params': account.non_embedding_params}, indent=2))
    writer = metrics.MetricsWriter(workdir, config.train.steps, start_step, enabled=is_writer)
    writer.print(f'{config.model.variant_name}: {account.params:,} params, mesh {dict(mesh.shape)}, '
                 f'{"resumed at step " + str(start_step) if latest is not None else "fresh start"}')

    preemption = _Preemption()
    losses: dict[int, float] = {}
    eval_loss = None
    pending: tuple[int, dict] | None = None
    interval_start, interval_steps = time.perf_counter(), 0

    def read(step: int, step_metrics: dict) -> None:
        """Host side of step `step`: NaN policy, loss record, periodic log line."""
        nonlocal interval_start, interval_steps
        host = jax.device_get(step_metrics)
        if not host['finite']:
            if config.train.nan_policy == 'error':
                raise TrainingError(f'non-finite loss, gradients or weights at step {step}; no checkpoint '
                                    f'of it was written (latest saved: '
                                    f'{manager.latest_step()}). Lower the LR or set train.nan_policy=skip.')
            logging.warning('step %d: non-finite loss, gradients or weights; update skipped', step)
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
        while step < config.train.steps:
            batch = trainer.device_batch(next(data_iterator))
            state, step_metrics = trainer.train_step(state, batch)
            step += 1
            if pending is not None:
                read(*pending)
            pending = (step, step_metrics)
            preempted = preemption.reached(step, config.train.log_every)
            at_end = step == config.train.steps
            saving = step % config.train.checkpoint_every == 0 or preempted or at_end
            evaluating = bool(config.train.eval_every and step % config.train.eval_every == 0) or at_end
            if saving or evaluating:
                read(*pending)  # the NaN policy sees a step before it is saved or evaluated
                pending = None
            if saving:
                checkpoint.save(manager, step, state, data_iterator, force=preempted or at_end)
            if evaluating:
                eval_loss = evaluate(trainer, state.params, config, tokenizer)
                writer.write(step, {'eval_loss': eval_loss, 'eval_perplexity': math.exp(min(eval_loss, 50))})
            if preempted and not at_end:
                manager.wait_until_finished()
                writer.print(f'preempted: saved step {step}; run the same command to resume')
                return RunResult(step, losses, eval_loss, state, preempted=True)
        if pending is not None:
            read(*pending)
        manager.wait_until_finished()
        if config.train.sample_prompt and config.train.sample_tokens:
            generator = decode.Generator(config.model, trainer.graphdef, state.params, config.data.seq_len,
                                         tokenizer.eos_id, trainer.mesh)
            prompt = data.prompt_tokens(config.data, tokenizer, config.train.sample_prompt)
            sampling = decode.Sampling(max_new_tokens=min(config.train.sample_tokens, config.data.seq_len - len(prompt)))
            completion = generator.generate([prompt], sampling).tokens[0]
            writer.print(f'sample (greedy): {config.train.sample_prompt}{tokenizer.decode(completion)}')
        return RunResult(step, losses, eval_loss, state, preempted=False)
    finally:
        manager.wait_until_finished()
        manager.close()
        preemption.restore()
        writer.close()
        getattr(data_iterator, 'close', lambda: None)()
