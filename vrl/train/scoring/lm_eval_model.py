"""lm-evaluation-harness's model interface over a vrl model: `VrlLM`, registered in lm-eval as `vrl`
(after `import vrl.train.scoring.lm_eval_model`, `lm_eval.simple_evaluate(model='vrl', model_args='workdir=DIR',
tasks=[...])` works), and `run_tasks`, which vrl.tools.evaluate (on a checkpoint) and vrl/train/downstream.py (on a
training run's live parameters) share; the tasks themselves: vrl/train/scoring/lm_eval_tasks.py.

VrlLM serves lm-eval's three request types in this process, sharded by the run's mesh:

- loglikelihood: context + continuation encoded as one text and split before the first token
  that covers the continuation (Tokenizer.encode_pair), after the separator the model saw at
  every document start in training (EOS [+ BOS]); a sequence longer than seq_len + 1 tokens
  loses context from the left.
- loglikelihood_rolling: the text in disjoint windows of seq_len predictions, each token predicted
  once, the last window with a full context (lm-eval's get_rolling_token_windows, as its HF models).
- generate_until: the KV-cache decoder (vrl/model/decode.py), cut at the first stop string.

Needs lm-eval (requirements-extra.txt).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import random
from typing import Any, Iterator

import jax
import numpy as np

# isort: off
from vrl.train.scoring import lm_eval_tasks  # first: without lm-eval, one line naming its install

# isort: on
import datasets  # lm-eval's own dependency
import lm_eval
import lm_eval.api.task
import lm_eval.evaluator
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from vrl.data import pipeline
from vrl.model import decode
from vrl.train.scoring.scorer import EvaluateError, Scorer, Sequence
from vrl.train.trained import TrainedRun, load_trained

# a task's data is loaded by Hugging Face datasets, whose progress bars would land on vrl's lines
datasets.disable_progress_bars()


@register_model('vrl')
class VrlLM(LM):
    """lm-eval's model interface over a vrl workdir's latest checkpoint (or a run already loaded)."""

    def __init__(self, workdir: str | TrainedRun, batch_size: int | str = 16, **lm_eval_options: Any):
        """lm_eval_options: what lm-eval passes every model (max_batch_size, device); vrl runs on the
        run's mesh instead."""
        super().__init__()
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise EvaluateError(
                f'batch_size={batch_size!r} is invalid: allowed an integer >= 1 (vrl does not pick one automatically).'
            )
        batch_size = int(batch_size)
        self.run = workdir if isinstance(workdir, TrainedRun) else load_trained(workdir)
        self.tokenizer = self.run.tokenizer
        self.max_len = self.run.config.data.seq_len
        self.separator = pipeline.prompt_tokens(self.run.config.data, self.tokenizer, '')
        self.scorer = Scorer(self.run, batch_size)
        self.generator = decode.Generator(
            self.run.config.model,
            self.run.trainer.graphdef,
            self.run.params,
            max_len=self.max_len,
            eos_id=self.tokenizer.eos_id,
            mesh=self.run.trainer.mesh,
        )

    def use(self, params: Any, step: int) -> None:
        """Scores with `params` (of the same model and layout) from now on, with no new compile."""
        self.run = self.run._replace(params=params, step=step)
        self.scorer.run = self.run
        self.generator.params = params

    def _request_sequence(self, context: str, continuation: str) -> Sequence:
        context_ids, continuation_ids = self.tokenizer.encode_pair(context, continuation)
        if not continuation_ids:
            raise EvaluateError(f'empty continuation after context {context[-40:]!r}: nothing to score.')
        if len(continuation_ids) > self.max_len:
            raise EvaluateError(
                f"a continuation of {len(continuation_ids)} tokens is longer than the model's "
                f'{self.max_len}-token context: it cannot be scored.'
            )
        ids = (self.separator + context_ids + continuation_ids)[-(self.max_len + 1) :]
        return ids, len(ids) - len(continuation_ids)

    def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:
        results = self.scorer.score([self._request_sequence(*r.args) for r in requests])
        for request, result in zip(requests, results):
            self.cache_hook.add_partial('loglikelihood', request.args, result)
        return results

    def _rolling_windows(self, text: str) -> list[Sequence]:
        """The text's ids (after the separator) as disjoint windows of at most seq_len predictions."""
        token_list = self.separator[1:] + self.tokenizer.encode(text).tolist()
        windows = []
        for context, predicted in map(
            make_disjoint_window,
            get_rolling_token_windows(
                token_list=token_list, prefix_token=self.separator[0], max_seq_len=self.max_len, context_len=1
            ),
        ):
            windows.append((context + predicted, len(context)))
        if windows:  # the separator's tail is context, not text to predict
            ids, n = windows[0]
            windows[0] = (ids, n + len(self.separator) - 1)
            if windows[0][1] == len(ids):
                windows.pop(0)
        return windows

    def loglikelihood_rolling(self, requests: list) -> list[float]:
        per_request = [self._rolling_windows(r.args[0]) for r in requests]
        scores = iter(self.scorer.score([w for windows in per_request for w in windows]))
        results = [sum(next(scores)[0] for _ in windows) for windows in per_request]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial('loglikelihood_rolling', request.args, result)
        return results

    def generate_until(self, requests: list) -> list[str]:
        """Greedy (or sampled, with do_sample) completions in batches of requests that share their
        generation settings; each is cut before its first stop string (`until`)."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        for indices in groups.values():
            settings = dict(requests[indices[0]].args[1])
            until = settings.pop('until', None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = max(1, min(int(settings.pop('max_gen_toks', 256)), self.max_len - 1))
            temperature = float(settings.pop('temperature', 0.0)) if settings.pop('do_sample', False) else 0.0
            sampling = decode.Sampling(
                temperature=temperature,
                top_k=int(settings.pop('top_k', 0) or 0),
                top_p=float(settings.pop('top_p', 1.0) or 1.0),
                max_new_tokens=max_new,
            )
            for start in range(0, len(indices), self.scorer.batch_size):
                batch = indices[start : start + self.scorer.batch_size]
                prompts = [
                    (self.separator + self.tokenizer.encode(requests[i].args[0]).tolist())[-(self.max_len - max_new) :]
                    for i in batch
                ]
                for i, tokens in zip(batch, self.generator.generate(prompts, sampling).tokens):
                    text = self.tokenizer.decode(t for t in tokens if t != self.tokenizer.eos_id)
                    for stop in until:
                        text = text.split(stop)[0]
                    results[i] = text
                    self.cache_hook.add_partial('generate_until', requests[i].args, text)
        return results


def run_tasks(
    model: VrlLM,
    tasks: list[str],
    task_manager: lm_eval_tasks.TaskManager,
    num_fewshot: int | None = None,
    limit: float | None = None,
    log_samples: bool = False,
    quiet: bool = False,
) -> dict:
    """lm-eval's results for the tasks on `model` (limit: examples per task, or a fraction below 1;
    quiet: without lm-eval's INFO lines and progress bars, as inside a training run). lm-eval seeds
    Python's and NumPy's global generators; their states are put back after. The results' environment
    report is JAX's (_jax_environment)."""
    if limit is not None and limit >= 1:
        limit = int(limit)  # lm-eval reads a float as a fraction
    states = random.getstate(), np.random.get_state()
    try:
        with _quieted() if quiet else contextlib.nullcontext(), _jax_environment():
            return lm_eval.simple_evaluate(
                model=model,
                tasks=tasks,
                num_fewshot=num_fewshot,
                limit=limit,
                log_samples=log_samples,
                task_manager=task_manager,
            )
    except (EvaluateError, decode.DecodeError):
        raise
    except Exception as e:  # noqa: BLE001 - narrowed to the task whose data fails, if any
        raise (lm_eval_tasks.unloadable_task(task_manager, tasks) or e) from e
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


@contextlib.contextmanager
def _jax_environment() -> Iterator[None]:
    """lm-eval's results describe the environment with JAX's report (jax.print_environment_info) for
    the duration, in place of lm-eval's own, PyTorch's (torch.utils.collect_env: it imports torch and
    runs pip, gcc and nvidia-smi, 5.7 s of a process's first scoring and 1.1 s of each after on 2 CPU
    cores, a pause in every in-training score)."""

    def add_env_info(results: dict) -> None:
        results.update(_environment())

    report = lm_eval.evaluator.add_env_info
    lm_eval.evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = report


@functools.cache
def _environment() -> dict[str, str]:
    """JAX's environment report and lm-eval's version: one process's, taken once (on a GPU host the
    report runs nvidia-smi)."""
    return {
        'pretty_env_info': jax.print_environment_info(return_string=True),
        'lm_eval_version': importlib.metadata.version('lm_eval'),
    }


@contextlib.contextmanager
def _quieted() -> Iterator[None]:
    """lm-eval's logger at WARNING and its per-task request-building bar off, and `datasets`' bars,
    for the duration."""
    logger, bar = logging.getLogger('lm-eval'), lm_eval.api.task.tqdm
    level = logger.level
    logger.setLevel(logging.WARNING)
    lm_eval.api.task.tqdm = functools.partial(bar, disable=True)
    try:
        with lm_eval_tasks.datasets_bars_off():
            yield
    finally:
        logger.setLevel(level)
        lm_eval.api.task.tqdm = bar
