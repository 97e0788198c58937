"""lm-evaluation-harness's model interface over a vrl model: `VrlLM`, registered in lm-eval as `vrl`
(after `import vrl.train.harness`, `lm_eval.simple_evaluate(model='vrl', model_args='workdir=DIR',
tasks=[...])` works), and the task index, loading and scoring that vrl.tools.evaluate (on a
checkpoint) and vrl/train/downstream.py (on a training run's live parameters) share.

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

import bisect
import contextlib
import difflib
import functools
import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
    import lm_eval
    import lm_eval.api.task
    import yaml  # lm-eval's own dependency
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
    raise ImportError(f'scoring lm-eval tasks (vrl.tools.evaluate, train.downstream_tasks) needs '
                      f'lm-evaluation-harness ({e}): pip install -r requirements-extra.txt') from e
import datasets  # lm-eval's own dependency

from vrl.core import sharding
from vrl.core.errors import VrlError
from vrl.data import pipeline
from vrl.model import decode
from vrl.train.trained import TrainedRun, load_trained

# a task's data is loaded by Hugging Face datasets, whose progress bars would land on vrl's lines
datasets.disable_progress_bars()


class EvaluateError(VrlError, ValueError):
    """Bad evaluation input (unknown task, unloadable task data, bad batch size); the message says what to do."""


Sequence = tuple[list[int], int]  # (token ids, n): score ids[n:], each given the ids before it


class Scorer:
    """Sums of log-probabilities of chosen tokens under a model. The sequences are packed into rows
    (each row's sequences masked from each other, positions restarting at each, as
    data.document_masking trains); a row is the power of two of tokens (from `chunk` up to
    seq_len) that holds four of the longest sequences, so its attention costs little more than the
    sequences' own, and a batch holds batch_size x seq_len tokens. A set of requests is one program
    (a program per row length: a handful at most). On several processes each supplies its share of
    every batch's rows (sharded as the train step's batch: TrainSteps.row_share) and every process
    receives all the scores."""

    def __init__(self, run: TrainedRun, batch_size: int, chunk: int = 64):
        """batch_size: seq_len-token rows' worth per batch, rounded up to a multiple of the devices the
        batch is split over; chunk: positions whose logits exist at once ((B, L, V) float32 would be GiBs)."""
        mesh, self.max_len = run.trainer.mesh, run.config.data.seq_len
        self.run, self.chunk = run, chunk
        splits = math.prod(mesh.shape[a] for a in sharding.spec_axes(run.trainer.batch_sharding.spec[0]))
        self.batch_size = -(-batch_size // splits) * splits
        self._scores = jax.jit(sharding.traced_in(mesh, self._token_scores), out_shardings=sharding.replicated(mesh))

    def row_length(self, longest: int) -> int:
        """Tokens per packed row for sequences of at most `longest` tokens."""
        length = self.chunk
        while length < min(4 * longest, self.max_len):
            length *= 2
        return min(length, self.max_len)

    def _token_scores(self, params: Any, rows: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Float32 log p(target) (B, L) and whether the target is the most likely token (B, L), from
        the logits of `chunk` positions at a time."""
        model = nnx.merge(self.run.trainer.graphdef, params)
        hidden_BxLxD = model.hidden(rows['inputs'], rows['positions'], rows['segment_ids'])
        B, L, D = hidden_BxLxD.shape
        C = math.gcd(L, self.chunk)

        def score(chunk):
            hidden_BxCxD, targets_BxC = chunk
            logits_BxCxV = model.logits(hidden_BxCxD)
            target_logits_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
            return (target_logits_BxC - jax.nn.logsumexp(logits_BxCxV, axis=-1),
                    logits_BxCxV.argmax(axis=-1) == targets_BxC)
        chunks = (hidden_BxLxD.reshape(B, L // C, C, D).swapaxes(0, 1),
                  rows['targets'].reshape(B, L // C, C).swapaxes(0, 1))
        log_probs_NxBxC, greedy_NxBxC = jax.lax.map(score, chunks)
        return log_probs_NxBxC.swapaxes(0, 1).reshape(B, L), greedy_NxBxC.swapaxes(0, 1).reshape(B, L)

    def score(self, sequences: list[Sequence]) -> list[tuple[float, bool]]:
        """For each (ids, n), 1 <= n < len(ids) <= seq_len + 1: (sum over t >= n of log p(ids[t] | ids[:t])
        in nats, whether every ids[t] is the model's argmax)."""
        for ids, n in sequences:
            if not 1 <= n < len(ids) <= self.max_len + 1:
                raise EvaluateError(f'cannot score {len(ids)} tokens from position {n}: allowed 1 <= n < length '
                                    f'<= seq_len + 1 = {self.max_len + 1}.')
        lengths = [len(ids) - 1 for ids, _ in sequences]
        L = self.row_length(max(lengths, default=1))
        rows, per_batch = _pack(lengths, L), self.batch_size * max(1, self.max_len // L)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(sequences)
        index, shares = self.run.trainer.row_share
        share = per_batch // shares
        for start in range(0, len(rows), per_batch):
            batch = rows[start:start + per_batch]
            placed = self.run.trainer.device_batch(_row_arrays(batch[share * index:share * (index + 1)], sequences,
                                                               share, L))
            log_probs_BxL, greedy_BxL = jax.device_get(self._scores(self.run.params, placed))
            for b, row in enumerate(batch):
                for i, offset in row:
                    ids, n = sequences[i]
                    scored = slice(offset + n - 1, offset + len(ids) - 1)  # position t - 1 predicts ids[t]
                    results[i] = (float(np.sum(log_probs_BxL[b, scored], dtype=np.float64)),
                                  bool(np.all(greedy_BxL[b, scored])))
        return results


def _pack(lengths: list[int], row_length: int) -> list[list[tuple[int, int]]]:
    """Rows of (sequence index, offset) holding sequences of the given lengths, each at most
    row_length: best fit, longest first, so few rows are left part empty."""
    rows: list[list[tuple[int, int]]] = []
    free: list[tuple[int, int]] = []  # (positions left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([])
            left, row = row_length, len(rows) - 1
        else:
            left, row = free.pop(at)
        rows[row].append((i, row_length - left))
        if left - lengths[i]:
            bisect.insort(free, (left - lengths[i], row))
    return rows


def _row_arrays(rows: list[list[tuple[int, int]]], sequences: list[Sequence], n_rows: int, length: int
                ) -> dict[str, np.ndarray]:
    """(n_rows, length) int32 inputs, targets, positions and segment ids (1, 2, ... per sequence of a row;
    0 after them) of packed rows; rows past `rows` are empty."""
    arrays = {k: np.zeros((n_rows, length), np.int32) for k in ('inputs', 'targets', 'positions', 'segment_ids')}
    for b, row in enumerate(rows):
        for segment, (i, offset) in enumerate(row, 1):
            ids = sequences[i][0]
            span = slice(offset, offset + len(ids) - 1)
            arrays['inputs'][b, span], arrays['targets'][b, span] = ids[:-1], ids[1:]
            arrays['positions'][b, span] = np.arange(len(ids) - 1)
            arrays['segment_ids'][b, span] = segment
    return arrays


@register_model('vrl')
class VrlLM(LM):
    """lm-eval's model interface over a vrl workdir's latest checkpoint (or a run already loaded)."""

    def __init__(self, workdir: str | TrainedRun, batch_size: int | str = 16, **lm_eval_options: Any):
        """lm_eval_options: what lm-eval passes every model (max_batch_size, device); vrl runs on the
        run's mesh instead."""
        super().__init__()
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise EvaluateError(f'batch_size={batch_size!r} is invalid: allowed an integer >= 1 (vrl does not '
                                'pick one automatically).')
        batch_size = int(batch_size)
        self.run = workdir if isinstance(workdir, TrainedRun) else load_trained(workdir)
        self.tokenizer = self.run.tokenizer
        self.max_len = self.run.config.data.seq_len
        self.separator = pipeline.prompt_tokens(self.run.config.data, self.tokenizer, '')
        self.scorer = Scorer(self.run, batch_size)
        self.generator = decode.Generator(self.run.config.model, self.run.trainer.graphdef, self.run.params,
                                          max_len=self.max_len, eos_id=self.tokenizer.eos_id,
                                          mesh=self.run.trainer.mesh)

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
            raise EvaluateError(f'a continuation of {len(continuation_ids)} tokens is longer than the model\'s '
                                f'{self.max_len}-token context: it cannot be scored.')
        ids = (self.separator + context_ids + continuation_ids)[-(self.max_len + 1):]
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
        for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                token_list=token_list, prefix_token=self.separator[0], max_seq_len=self.max_len, context_len=1)):
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
            sampling = decode.Sampling(temperature=temperature, top_k=int(settings.pop('top_k', 0) or 0),
                                       top_p=float(settings.pop('top_p', 1.0) or 1.0), max_new_tokens=max_new)
            for start in range(0, len(indices), self.scorer.batch_size):
                batch = indices[start:start + self.scorer.batch_size]
                prompts = [(self.separator + self.tokenizer.encode(requests[i].args[0]).tolist())[-(self.max_len - max_new):]
                           for i in batch]
                for i, tokens in zip(batch, self.generator.generate(prompts, sampling).tokens):
                    text = self.tokenizer.decode(t for t in tokens if t != self.tokenizer.eos_id)
                    for stop in until:
                        text = text.split(stop)[0]
                    results[i] = text
                    self.cache_hook.add_partial('generate_until', requests[i].args, text)
        return results


def check_tasks(task_manager: TaskManager, tasks: list[str], include_path: str | None = None) -> None:
    """EvaluateError naming each task lm-eval does not know, with close matches, and each task file in
    include_path that does not parse (lm-eval skips those silently)."""
    unknown = [t for t in tasks if not task_manager.match_tasks([t])]
    if unknown:
        broken = _broken_task_files(include_path) if include_path else []
        if broken:
            raise EvaluateError(f'unknown task(s) {", ".join(map(repr, unknown))}; task files in --include_path '
                                f'that do not parse: {"; ".join(broken)}.')
        close = {t: difflib.get_close_matches(t, task_manager.all_tasks, 3) for t in unknown}
        hints = '; '.join(f'{t!r}: did you mean {", ".join(matches)}?' if matches else f'{t!r}: no close match'
                          for t, matches in close.items())
        raise EvaluateError(f'unknown task(s) {", ".join(map(repr, unknown))} ({hints}). `lm-eval ls tasks` lists '
                            f'the {len(task_manager.all_tasks)} names lm-eval {lm_eval.__version__} knows; a task of '
                            'your own is a YAML file in a folder passed with --include_path.')


class _TaskYamlLoader(yaml.SafeLoader):
    """YAML as lm-eval writes it, its `!function` tags read as plain strings."""


_TaskYamlLoader.add_multi_constructor('!', lambda loader, tag, node: str(node.value))


def _task_yaml(path: Path) -> dict:
    with open(path, 'rb') as f:
        cfg = yaml.load(f, Loader=_TaskYamlLoader)  # noqa: S506 - a safe loader with one more constructor
    if not isinstance(cfg, dict):
        raise ValueError(f'a task file holds a mapping, not a {type(cfg).__name__}')
    return cfg


def _broken_task_files(include_path: str) -> list[str]:
    """'file:line: the parser's message' for each YAML under include_path that lm-eval cannot read."""
    broken = []
    for path in sorted(p for p in Path(include_path).rglob('*') if p.suffix in ('.yaml', '.yml')):
        try:
            _task_yaml(path)
        except yaml.MarkedYAMLError as e:
            line = f':{e.problem_mark.line + 1}' if e.problem_mark else ''
            broken.append(f'{path}{line}: {" ".join(f"{e.problem or e.context}".split())}')
        except (yaml.YAMLError, ValueError) as e:
            broken.append(f'{path}: {" ".join(str(e).split())}')
    return broken


def _bad_json_line(task_manager: TaskManager, task: str) -> str | None:
    """'file:line is not valid JSON (why)' for the first bad line of a local JSON-lines data file of the
    task's YAML (dataset_path: json), or None."""
    entry = task_manager.task_index.get(task)
    try:
        cfg = _task_yaml(entry.yaml_path) if entry and entry.yaml_path else {}
    except (OSError, yaml.YAMLError, ValueError):  # an unreadable YAML is reported by check_tasks
        return None
    if cfg.get('dataset_path') != 'json':
        return None
    files = (cfg.get('dataset_kwargs') or {}).get('data_files') or []
    for file in files.values() if isinstance(files, dict) else [files]:
        for name in [file] if isinstance(file, str) else file:
            if not Path(name).is_file():
                continue
            for number, line in enumerate(Path(name).read_text(encoding='utf-8', errors='replace').splitlines(), 1):
                try:
                    if line.strip():
                        json.loads(line)
                except json.JSONDecodeError as e:
                    return f'{name}:{number} is not valid JSON ({e.msg}, column {e.colno})'
    return None


def _unloadable_task(task_manager: TaskManager, tasks: list[str]) -> EvaluateError | None:
    """After a failure inside lm-eval: the first task whose data cannot be loaded, as an error
    that says how to provide it; None if every task loads (the failure was elsewhere)."""
    for task in tasks:
        try:
            task_manager.load([task])
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message carries its reason
            bad_line = _bad_json_line(task_manager, task)
            if bad_line:
                return EvaluateError(f'task {task!r}: its data could not be loaded: {bad_line}; fix or remove that '
                                     'line.')
            reason = ' '.join(f'{type(e).__name__}: {e}'.split())[:400]
            return EvaluateError(
                f'task {task!r}: its data could not be loaded ({reason}). lm-eval reads task data with Hugging '
                "Face `datasets` (the task YAML's dataset_path) from the Hub or the local cache (HF_DATASETS_CACHE). "
                'On a machine without the Hub, copy that cache from one that has it, or write a task YAML with '
                '`dataset_path: json` and `dataset_kwargs: {data_files: {test: /path/to/file.jsonl}}` in a folder '
                'passed with --include_path (docs/evaluation.md).')
    return None


def task_manager_for(tasks: list[str], include_path: str | None = None) -> TaskManager:
    """lm-eval's task index: of include_path alone when it holds every task (indexing lm-eval's
    thousands of built-in tasks takes ~10 s), else of both; EvaluateError for unknown names."""
    if not tasks:
        raise EvaluateError('no task given: --tasks=hellaswag,piqa,... (`lm-eval ls tasks` lists them).')
    if include_path:
        if not Path(include_path).is_dir():
            raise EvaluateError(f'--include_path={include_path} is not a folder: give the folder holding your '
                                'task YAMLs.')
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([t]) for t in tasks):
            return local
    task_manager = TaskManager(include_path=include_path)
    check_tasks(task_manager, tasks, include_path)
    return task_manager


def load_tasks(tasks: list[str], include_path: str | None = None, quiet: bool = False) -> TaskManager:
    """task_manager_for, then each task's data loaded once: EvaluateError, saying how to provide it,
    for the first task whose data cannot be loaded (before hours of training, not after); quiet:
    without the `datasets` library's progress bars (a pod's other hosts)."""
    task_manager = task_manager_for(tasks, include_path)
    with _datasets_bars_off() if quiet else contextlib.nullcontext():
        failure = _unloadable_task(task_manager, tasks)
    if failure:
        raise failure
    return task_manager


def run_tasks(model: VrlLM, tasks: list[str], task_manager: TaskManager, num_fewshot: int | None = None,
              limit: float | None = None, log_samples: bool = False, quiet: bool = False) -> dict:
    """lm-eval's results for the tasks on `model` (limit: examples per task, or a fraction below 1;
    quiet: without lm-eval's INFO lines and progress bars, as inside a training run). lm-eval seeds
    Python's and NumPy's global generators; their states are put back after."""
    if limit is not None and limit >= 1:
        limit = int(limit)  # lm-eval reads a float as a fraction
    states = random.getstate(), np.random.get_state()
    try:
        with _quieted() if quiet else contextlib.nullcontext():
            return lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                           log_samples=log_samples, task_manager=task_manager)
    except (EvaluateError, decode.DecodeError):
        raise
    except Exception as e:  # noqa: BLE001 - narrowed to the task whose data fails, if any
        raise (_unloadable_task(task_manager, tasks) or e) from e
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


@contextlib.contextmanager
def _quieted() -> Iterator[None]:
    """lm-eval's logger at WARNING and its per-task request-building bar off, and `datasets`' bars,
    for the duration."""
    logger, bar = logging.getLogger('lm-eval'), lm_eval.api.task.tqdm
    level = logger.level
    logger.setLevel(logging.WARNING)
    lm_eval.api.task.tqdm = functools.partial(bar, disable=True)
    try:
        with _datasets_bars_off():
            yield
    finally:
        logger.setLevel(level)
        lm_eval.api.task.tqdm = bar


@contextlib.contextmanager
def _datasets_bars_off() -> Iterator[None]:
    """The `datasets` library's progress bars (building a task's split) off, for the duration."""
    import datasets
    was_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def task_metrics(results: dict, tasks: list[str]) -> dict[str, dict[str, float]]:
    """{requested task: {metric: value}}: lm-eval's numbers without their stderr, named 'acc' for
    lm-eval's 'acc,none' and 'acc_FILTER' for another filter; a group without its own aggregate
    gets each subtask's, named 'subtask/metric'."""
    def numbers(task: str, prefix: str = '') -> dict[str, float]:
        named, scored = {}, results.get('higher_is_better', {}).get(task)  # its metrics, not e.g. sample_len
        for key, value in results['results'].get(task, {}).items():
            metric, _, filter_name = key.partition(',')
            if isinstance(value, (int, float)) and (metric in scored if scored else '_stderr' not in metric):
                named[prefix + metric + ('' if filter_name in ('', 'none') else f'_{filter_name}')] = float(value)
        return named
    by_task = {}
    for task in tasks:
        by_task[task] = numbers(task)
        if not by_task[task]:
            for subtask in results.get('group_subtasks', {}).get(task, []):
                by_task[task].update(numbers(subtask, f'{subtask}/'))
    return by_task
