"""Downstream tasks through EleutherAI's lm-evaluation-harness, on a trained workdir:

    python -m vrl.tools.evaluate --workdir=DIR --tasks=hellaswag,piqa [--num_fewshot=K] [--limit=N]
        [--batch_size=B] [--include_path=DIR] [--log_samples]

The workdir's latest checkpoint is scored in this process, sharded by the run's mesh over this
machine's devices, by vrl/train/scoring/lm_eval_model.py's `VrlLM` (lm-eval's model `vrl`, registered
when scoring starts).
Writes lm-eval's results JSON and its table to WORKDIR/lm_eval/results_<time>.{json,md} (with
--log_samples, also samples_<task>_<time>.jsonl, one scored request per line).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from absl import flags
from etils import epath

from vrl.core import cli, extras, storage
from vrl.train.rundir import checkpoint

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager


@dataclasses.dataclass
class EvalOutputs:
    results: dict  # lm-eval's results, as simple_evaluate returns them
    table: str  # lm-eval's markdown table (tasks, then groups)
    files: list[Path]


def evaluate(
    workdir: str,
    tasks: list[str],
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 16,
    include_path: str | None = None,
    log_samples: bool = False,
    task_manager: TaskManager | None = None,
) -> EvalOutputs:
    """Runs lm-eval's tasks on the workdir's latest checkpoint and writes WORKDIR/lm_eval/results_<time>.*
    (limit: examples per task, or a fraction below 1; task_manager: one from task_manager_for, to share
    among several workdirs)."""
    extras.require('vrl.tools.evaluate (lm-evaluation-harness)', 'lm_eval')
    from vrl.train.scoring.lm_eval_model import VrlLM, run_tasks  # registers lm-eval's model `vrl`
    from vrl.train.scoring.lm_eval_tasks import task_manager_for

    checkpoint.step_folder(workdir)  # no checkpoint: say so before indexing thousands of tasks
    task_manager = task_manager or task_manager_for(tasks, include_path)
    model = VrlLM(workdir, batch_size)
    results = run_tasks(model, tasks, task_manager, num_fewshot, limit, log_samples)
    return _write(storage.path(workdir) / 'lm_eval', results, model.run.step)


def _write(out: epath.Path, results: dict, step: int | None) -> EvalOutputs:
    from lm_eval.utils import handle_non_serializable, make_table

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
        files[-1].write_text(
            ''.join(json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + '\n' for s in task_samples)
        )
    return EvalOutputs(results, table, files)


def _define_flags() -> dict[str, flags.FlagHolder]:
    return {
        'workdir': flags.DEFINE_string('workdir', None, 'A training workdir (config.json + checkpoints/).'),
        'tasks': flags.DEFINE_list('tasks', [], 'lm-eval task, group or tag names, comma-separated.'),
        'num_fewshot': flags.DEFINE_integer('num_fewshot', None, "Few-shot examples; unset = each task's default."),
        'limit': flags.DEFINE_float('limit', None, 'Examples per task (< 1: a fraction); for quick checks.'),
        'batch_size': flags.DEFINE_integer(
            'batch_size',
            16,
            "Forward passes take this many seq_len rows' worth of tokens, the requests packed into them.",
        ),
        'include_path': flags.DEFINE_string('include_path', None, 'A folder of task YAMLs of your own.'),
        'log_samples': flags.DEFINE_boolean('log_samples', False, 'Also write each scored request.'),
    }


def main(args: cli.Args) -> None:
    cli.require(args, 'workdir')
    outputs = evaluate(
        args['workdir'].value,
        args['tasks'].value,
        args['num_fewshot'].value,
        args['limit'].value,
        args['batch_size'].value,
        args['include_path'].value,
        args['log_samples'].value,
    )
    print(outputs.table)
    print('wrote ' + ', '.join(str(f) for f in outputs.files))


def cli_main() -> None:
    """`vrl-evaluate` (pyproject.toml's scripts): `python -m vrl.tools.evaluate` by another name."""
    cli.run(main, _define_flags)


if __name__ == '__main__':
    cli_main()
