"""Downstream tasks through EleutherAI's lm-evaluation-harness, on a trained workdir:

    python -m vrl.tools.evaluate --workdir=DIR --tasks=hellaswag,piqa [--num_fewshot=K] [--limit=N]
        [--batch_size=B] [--include_path=DIR] [--log_samples]

`VrlLM` (registered in lm-eval as `vrl`: after `import vrl.tools.evaluate`,
`lm_eval.simple_evaluate(model='vrl', model_args='workdir=DIR', tasks=[...])` works too) serves
lm-eval's three request types with the workdir's latest checkpoint, in this process, sharded by
the run's mesh over its devices:

- loglikelihood: context + continuation encoded as one text and split before the first token
  that covers the continuation (Tokenizer.encode_pair), after the separator the model saw at
  every document start in training (EOS [+ BOS]); a sequence longer than seq_len + 1 tokens
  loses context from the left.
- loglikelihood_rolling: the text in disjoint windows of seq_len predictions, each token predicted
  once, the last window with a full context (lm-eval's get_rolling_token_windows, as its HF models).
- generate_until: the KV-cache decoder (vrl/model/decode.py), cut at the first stop string.

Writes lm-eval's results JSON and its table to WORKDIR/lm_eval/results_<time>.{json,md} (with
--log_samples, also samples_<task>_<time>.jsonl, one scored request per line).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from etils import epath
from flax import nnx

try:
    import lm_eval
    import yaml  # lm-eval's own dependency
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import (
        get_rolling_token_windows,
        handle_non_serializable,
        make_disjoint_window,
        make_table,
    )
except ImportError as e:
    raise ImportError(f'vrl.tools.evaluate needs lm-evaluation-harness ({e}): pip install -r requirements-extra.txt'
                      ) from e

from vrl.core import cli, sharding, storage
from vrl.core.errors import VrlError
from vrl.data import pipeline
from vrl.model import decode
from vrl.train import checkpoint
from vrl.train.trained import TrainedRun, load_trained


class EvaluateError(VrlError, ValueError):
    """Bad evaluation input (unknown task, unloadable task data, bad batch size); the message says what to do."""


Sequence = tuple[list[int], int]  # (token ids, n): score ids[n:], each given the ids before it


class Scorer:
    """Sums of log-probabilities of chosen tokens under a trained model, in batches of fixed
    shape (batch_size x a multiple of `chunk` up to seq_len), so a few programs serve any request mix."""

    def __init__(self, run: TrainedRun, batch_size: int, chunk: int = 64):
        """chunk: positions whose logits exist at once ((B, L, V) float32 would be GiBs)."""
        self.run, self.batch_size, self.chunk, self.max_len = run, batch_size, chunk, run.config.data.seq_len
        self._scores = jax.jit(sharding.traced_in(run.trainer.mesh, self._token_scores))

    def _token_scores(self, params: Any, inputs_BxL: jax.Array, targets_BxL: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
        """Float32 log p(target) (B, L) and whether the target is the most likely token (B, L), from
        the logits of `chunk` positions at a time."""
        model = nnx.merge(self.run.trainer.graphdef, params)
        hidden_BxLxD = model.hidden(inputs_BxL)
        B, L, D = hidden_BxLxD.shape
        C = math.gcd(L, self.chunk)

        def score(chunk):
            hidden_BxCxD, targets_BxC = chunk
            logits_BxCxV = model.logits(hidden_BxCxD)
            target_logits_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
            return (target_logits_BxC - jax.nn.logsumexp(logits_BxCxV, axis=-1),
                    logits_BxCxV.argmax(axis=-1) == targets_BxC)
        chunks = (hidden_BxLxD.reshape(B, L // C, C, D).swapaxes(0, 1), targets_BxL.reshape(B, L // C, C).swapaxes(0, 1))
        log_probs_NxBxC, greedy_NxBxC = jax.lax.map(score, chunks)
        return log_probs_NxBxC.swapaxes(0, 1).reshape(B, L), greedy_NxBxC.swapaxes(0, 1).reshape(B, L)

    def _length_bucket(self, n: int) -> int:
        return min(self.max_len, -(-n // self.chunk) * self.chunk)

    def score(self, sequences: list[Sequence]) -> list[tuple[float, bool]]:
        """For each (ids, n), 1 <= n < len(ids) <= seq_len + 1: (sum over t >= n of log p(ids[t] | ids[:t])
        in nats, whether every ids[t] is the model's argmax). Longest first, as lm-eval does, so
        the first batch shows any memory problem at once."""
        for ids, n in sequences:
            if not 1 <= n < len(ids) <= self.max_len + 1:
                raise EvaluateError(f'cannot score {len(ids)} tokens from position {n}: allowed 1 <= n < length '
                                    f'<= seq_len + 1 = {self.max_len + 1}.')
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(sequences)
        mesh = self.run.trainer.mesh
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            L = self._length_bucket(len(sequences[rows[0]][0]) - 1)
            inputs_BxL = np.zeros((self.batch_size, L), np.int32)
            targets_BxL = np.zeros((self.batch_size, L), np.int32)
            for b, i in enumerate(rows):
                ids = sequences[i][0]
                inputs_BxL[b, :len(ids) - 1], targets_BxL[b, :len(ids) - 1] = ids[:-1], ids[1:]
            placed = [jax.device_put(x, sharding.fitted_sharding(mesh, ('batch', 'length'), x.shape))
                      for x in (inputs_BxL, targets_BxL)]
            log_probs_BxL, greedy_BxL = jax.device_get(self._scores(self.run.params, *placed))
            for b, i in enumerate(rows):
                ids, n = sequences[i]
                scored = slice(n - 1, len(ids) - 1)  # position t - 1 predicts ids[t]
                results[i] = (float(np.sum(log_probs_BxL[b, scored], dtype=np.float64)),
                              bool(np.all(greedy_BxL[b, scored])))
        return results


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


@dataclasses.dataclass
class EvalOutputs:
    results: dict  # lm-eval's results, as simple_evaluate returns them
    table: str  # lm-eval's markdown table (tasks, then groups)
    files: list[Path]


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


def evaluate(workdir: str, tasks: list[str], num_fewshot: int | None = None, limit: float | None = None,
             batch_size: int = 16, include_path: str | None = None, log_samples: bool = False,
             task_manager: TaskManager | None = None) -> EvalOutputs:
    """Runs lm-eval's tasks on the workdir's latest checkpoint and writes WORKDIR/lm_eval/results_<time>.*
    (limit: examples per task, or a fraction below 1; task_manager: one from task_manager_for, to share
    among several workdirs)."""
    if limit is not None and limit >= 1:
        limit = int(limit)  # lm-eval reads a float as a fraction
    checkpoint.step_folder(workdir)  # no checkpoint: say so before indexing thousands of tasks
    task_manager = task_manager or task_manager_for(tasks, include_path)
    model = VrlLM(workdir, batch_size)
    try:
        results = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          log_samples=log_samples, task_manager=task_manager)
    except (EvaluateError, decode.DecodeError):
        raise
    except Exception as e:  # noqa: BLE001 - narrowed to the task whose data fails, if any
        raise (_unloadable_task(task_manager, tasks) or e) from e
    return _write(storage.path(workdir) / 'lm_eval', results, model.run.step)


def _write(out: epath.Path, results: dict, step: int | None) -> EvalOutputs:
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime('%Y%m%d-%H%M%S')
    samples = results.pop('samples', None) or {}
    results['vrl'] = {'step': step}
    table = make_table(results) + (make_table(results, 'groups') if results.get('groups') else '')
    files = [out / f'results_{stamp}.json', out / f'results_{stamp}.md']
    files[0].write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    files[1].write_text(table)
    for task, task_samples in samples.items():
        files.append(out / f'samples_{task}_{stamp}.jsonl')
        files[-1].write_text(''.join(json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + '\n'
                                     for s in task_samples))
    return EvalOutputs(results, table, files)


def _define_flags() -> dict[str, flags.FlagHolder]:
    return {
        'workdir': flags.DEFINE_string('workdir', None, 'A training workdir (config.json + checkpoints/).'),
        'tasks': flags.DEFINE_list('tasks', [], 'lm-eval task, group or tag names, comma-separated.'),
        'num_fewshot': flags.DEFINE_integer('num_fewshot', None, "Few-shot examples; unset = each task's default."),
        'limit': flags.DEFINE_float('limit', None, 'Examples per task (< 1: a fraction); for quick checks.'),
        'batch_size': flags.DEFINE_integer('batch_size', 16, 'Sequences per forward pass.'),
        'include_path': flags.DEFINE_string('include_path', None, 'A folder of task YAMLs of your own.'),
        'log_samples': flags.DEFINE_boolean('log_samples', False, 'Also write each scored request.'),
    }


def main(args: cli.Args) -> None:
    cli.require(args, 'workdir')
    outputs = evaluate(args['workdir'].value, args['tasks'].value, args['num_fewshot'].value,
                       args['limit'].value, args['batch_size'].value, args['include_path'].value,
                       args['log_samples'].value)
    print(outputs.table)
    print('wrote ' + ', '.join(str(f) for f in outputs.files))


if __name__ == '__main__':
    cli.run(main, _define_flags)
