"""lm-eval tasks for vrl: found by name (with close matches for a typo), task files of one's own
checked (a YAML lm-eval would skip silently, a JSON line that does not parse), loaded, and their
results read as {task: {metric: value}}. Needs lm-eval (requirements-extra.txt)."""

from __future__ import annotations

import contextlib
import difflib
import json
from pathlib import Path
from typing import Iterator

try:
    import lm_eval
    import yaml  # lm-eval's own dependency
    from lm_eval.tasks import TaskManager
except ImportError as e:
    raise ImportError(
        f'scoring lm-eval tasks (vrl.tools.evaluate, train.downstream_tasks) needs '
        f'lm-evaluation-harness ({e}): pip install -r requirements-extra.txt'
    ) from e

from vrl.train.scoring.scorer import EvaluateError


def check_tasks(task_manager: TaskManager, tasks: list[str], include_path: str | None = None) -> None:
    """EvaluateError naming each task lm-eval does not know, with close matches, and each task file in
    include_path that does not parse (lm-eval skips those silently)."""
    unknown = [t for t in tasks if not task_manager.match_tasks([t])]
    if unknown:
        broken = _broken_task_files(include_path) if include_path else []
        if broken:
            raise EvaluateError(
                f'unknown task(s) {", ".join(map(repr, unknown))}; task files in --include_path '
                f'that do not parse: {"; ".join(broken)}.'
            )
        close = {t: difflib.get_close_matches(t, task_manager.all_tasks, 3) for t in unknown}
        hints = '; '.join(
            f'{t!r}: did you mean {", ".join(matches)}?' if matches else f'{t!r}: no close match'
            for t, matches in close.items()
        )
        raise EvaluateError(
            f'unknown task(s) {", ".join(map(repr, unknown))} ({hints}). `lm-eval ls tasks` lists '
            f'the {len(task_manager.all_tasks)} names lm-eval {lm_eval.__version__} knows; a task of '
            'your own is a YAML file in a folder passed with --include_path.'
        )


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


def unloadable_task(task_manager: TaskManager, tasks: list[str]) -> EvaluateError | None:
    """After a failure inside lm-eval: the first task whose data cannot be loaded, as an error
    that says how to provide it; None if every task loads (the failure was elsewhere)."""
    for task in tasks:
        try:
            task_manager.load([task])
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message carries its reason
            bad_line = _bad_json_line(task_manager, task)
            if bad_line:
                return EvaluateError(
                    f'task {task!r}: its data could not be loaded: {bad_line}; fix or remove that line.'
                )
            reason = ' '.join(f'{type(e).__name__}: {e}'.split())[:400]
            return EvaluateError(
                f'task {task!r}: its data could not be loaded ({reason}). lm-eval reads task data with Hugging '
                "Face `datasets` (the task YAML's dataset_path) from the Hub or the local cache (HF_DATASETS_CACHE). "
                'On a machine without the Hub, copy that cache from one that has it, or write a task YAML with '
                '`dataset_path: json` and `dataset_kwargs: {data_files: {test: /path/to/file.jsonl}}` in a folder '
                'passed with --include_path (docs/evaluation.md).'
            )
    return None


def task_manager_for(tasks: list[str], include_path: str | None = None) -> TaskManager:
    """lm-eval's task index: of include_path alone when it holds every task (indexing lm-eval's
    thousands of built-in tasks takes ~10 s), else of both; EvaluateError for unknown names."""
    if not tasks:
        raise EvaluateError('no task given: --tasks=hellaswag,piqa,... (`lm-eval ls tasks` lists them).')
    if include_path:
        if not Path(include_path).is_dir():
            raise EvaluateError(
                f'--include_path={include_path} is not a folder: give the folder holding your task YAMLs.'
            )
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
    with datasets_bars_off() if quiet else contextlib.nullcontext():
        failure = unloadable_task(task_manager, tasks)
    if failure:
        raise failure
    return task_manager


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


@contextlib.contextmanager
def datasets_bars_off() -> Iterator[None]:
    """The `datasets` library's progress bars (building a task's split) off, for the duration."""
    import datasets

    was_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()
