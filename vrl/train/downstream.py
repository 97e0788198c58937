"""Downstream tasks while a run trains: lm-eval's tasks (train.downstream_tasks) scored on the live
parameters every train.downstream_every steps and at the end, with no checkpoint written or read.

The tasks are indexed and their data loaded at start-up, before anything compiles, so a task that
cannot be loaded stops the run in one line then. Scoring is vrl/train/scoring/lm_eval_model.py's (`VrlLM`: the
requests packed into rows, data.batch_size / train.microbatches sequences' worth of tokens at a
time, the same tasks one compiled program for the whole run) and gives the numbers
vrl.tools.evaluate gives for a checkpoint of the same step. On a pod every process runs lm-eval on the same requests;
each
supplies its share of every batch's rows, as in training, and receives every score, and process 0
writes `downstream/TASK/METRIC` (lm-eval's metric: acc, acc_norm, perplexity, ...) to
metrics.jsonl, TensorBoard and W&B beside the loss.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from vrl.core import multihost
from vrl.data.tokenizer import Tokenizer
from vrl.train.config import Config, TrainConfig
from vrl.train.hooks import Member, Scoring
from vrl.train.start import TrainingError
from vrl.train.step import RunGroup, TrainState, TrainSteps
from vrl.train.trained import TrainedRun


def load(train: TrainConfig) -> Any:
    """lm-eval's index of train.downstream_tasks with each task's data loaded once (on every process:
    each reads its own copy), or None when there are none; a missing lm-eval, an unknown task or
    data that cannot be loaded stops every process in one line."""
    if not train.task_names:
        return None

    def index() -> Any:
        try:
            from vrl.train.scoring import lm_eval_tasks, scorer
        except ImportError as e:
            raise TrainingError(f'train.downstream_tasks={train.downstream_tasks!r}: {e}') from None
        try:
            return lm_eval_tasks.load_tasks(
                train.task_names, train.downstream_include_path or None, quiet=jax.process_index() != 0
            )  # the others print two lines only
        except scorer.EvaluateError as e:  # its advice names the command's flag; here that is a config field
            message = str(e).replace('--include_path', 'train.downstream_include_path')
            raise TrainingError(f'train.downstream_tasks: {message}') from None

    return multihost.everywhere(index)


class Downstream(Scoring):
    """train.downstream_tasks scored for each run of a group."""

    def __init__(
        self,
        config: Config,
        trainer: TrainSteps,
        group: RunGroup,
        members: list[Member],
        tokenizer: Tokenizer,
        task_manager: Any,
    ):
        # lm-eval: requirements-extra.txt, present since `load` found the tasks
        from vrl.train.scoring import lm_eval_model

        self.config, self.group, self.members, self.task_manager = config, group, members, task_manager
        rows = config.data.batch_size // config.train.microbatches
        self.model = lm_eval_model.VrlLM(TrainedRun(config, tokenizer, trainer, None, None), batch_size=rows)

    def score(self, step: int, state: TrainState) -> None:
        from vrl.train.scoring import lm_eval_model, lm_eval_tasks

        train = self.config.train
        for i, m in enumerate(self.members):
            started = time.perf_counter()
            self.model.use(self.group.member(state.params, i), step)
            results = lm_eval_model.run_tasks(
                self.model,
                train.task_names,
                self.task_manager,
                None if train.downstream_fewshot < 0 else train.downstream_fewshot,
                train.downstream_limit or None,
                quiet=True,
            )
            scores = lm_eval_tasks.task_metrics(results, train.task_names)
            m.writer.write(
                step,
                {
                    f'downstream/{task}/{metric}': value
                    for task, metrics in scores.items()
                    for metric, value in metrics.items()
                }
                | {'downstream_seconds': time.perf_counter() - started},
            )
