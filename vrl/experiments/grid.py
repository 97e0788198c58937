"""A grid of training runs in one directory: what `vrl.experiments.compare` and `vrl.experiments.study` share.

Each run is a vrl.main workdir, DIR/runs/<name>/, trained on the local devices (on a pod every
host runs the same command, so each run uses all hosts); runs that differ only in seed are trained
together, one compiled step over a run axis (`train_all`; vrl/train/step.py's RunGroup), the rest one
after another. A finished run (its
result.json exists) is read back, an unfinished one resumes from its checkpoint, so widening a
grid trains only the new runs and an interrupted grid continues where it stopped. DIR/<record>
holds the grid's base config; another base config in the same DIR is refused, and one process
at a time may write DIR (`GridDirectory`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from vrl.core import multihost, storage
from vrl.core.errors import VrlError
from vrl.experiments import analyze
from vrl.experiments import ledger as ledger_lib
from vrl.model import accounting
from vrl.train import loop
from vrl.train.config import Config
from vrl.train.rundir import checkpoint
from vrl.train.rundir import guard as guard_lib
from vrl.train.rundir import workdir as workdir_lib
from vrl.train.trackers import stored

BASELINE = 'vanilla'  # what every statistic of a comparison or study is measured against


class GridError(VrlError, ValueError):
    """Bad grid input; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One point of a grid: a preset variant, an init seed, the full config and, for a study, the
    other coordinates (e.g. (('size', 'd128'), ('lr', '3e-03'))) that name its folder."""

    variant: str
    seed: int
    config: Config
    coordinates: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return '-'.join([self.variant.replace(':', '-'), *(value for _, value in self.coordinates), f's{self.seed}'])


@dataclasses.dataclass
class Downstream:
    """lm-eval tasks to run on every run (vrl.tools.evaluate), with one task index for all of them."""

    tasks: list[str]
    limit: float | None = None
    include_path: str | None = None
    _task_manager: Any = dataclasses.field(default=None, init=False, repr=False)

    def index(self) -> Any:
        """lm-eval's TaskManager for the tasks, built once; EvaluateError names an unknown task."""
        from vrl.train.scoring import lm_eval_tasks  # lm-eval: requirements-extra.txt

        if self._task_manager is None:
            self._task_manager = lm_eval_tasks.task_manager_for(self.tasks, self.include_path)
        return self._task_manager

    def metrics(self, run_dir: epath.Path, tasks: list[str]) -> dict[str, dict[str, float]]:
        """{requested task: {metric: value}} on the run's latest checkpoint (lm_eval_tasks.task_metrics)."""
        from vrl.tools import evaluate  # lm-eval: requirements-extra.txt
        from vrl.train.scoring import lm_eval_tasks

        results = evaluate.evaluate(str(run_dir), tasks, limit=self.limit, task_manager=self.index()).results
        return lm_eval_tasks.task_metrics(results, tasks)


class GridDirectory:
    """DIR of a comparison or study: its one writer (a lock on DIR/.lock) and its base-config record.

    `open` refuses, before anything is written, a DIR whose record holds another base config (naming
    the first difference) or that another process is writing (naming it); `write_text` replaces a
    report file atomically, so a reader never sees half of one."""

    def __init__(self, path: epath.Path, record: str, kind: str):
        self.path, self.record, self.kind = path, path / record, kind
        self._guard: guard_lib.Guard | None = None

    def open(self, base: Config) -> None:
        self.check_same_base(base)
        self._guard = guard_lib.make(self.path, self.kind, base.train.lease_stale_seconds)

        def hold() -> None:
            guard_lib.hold(self._guard)
            self.check_same_base(base)  # a writer that finished just before us may have written it
            self.write_text(self.record.name, json.dumps({'base_config': dataclasses.asdict(base)}, indent=2))

        multihost.on_process_0(hold)

    def close(self) -> None:
        if self._guard is not None:
            self._guard.release()

    def check_same_base(self, base: Config) -> None:
        if not self.record.exists():
            return
        saved = json.loads(self.record.read_text())['base_config']
        for name, (old, value) in workdir_lib.changes(saved, workdir_lib.as_json(base)).items():
            raise GridError(
                f'{self.path} holds a {self.kind} of another config: {name} was {old!r} there and is '
                f'{value!r} now; use another --workdir (nothing was changed).'
            )

    def write_text(self, name: str, text: str) -> epath.Path:
        """DIR/name replaced whole by `text` (process 0 only)."""
        target = self.path / name
        if jax.process_index() == 0:
            storage.write_bytes(target, text.encode())
        return target


def train_all(
    runs: list[Run],
    workdir: epath.Path,
    analysis_sequences: int,
    downstream: Downstream | None = None,
    group_runs: bool = True,
    held: ledger_lib.Ledger | None = None,
) -> list[dict[str, Any]]:
    """Every run's result (`train_or_reuse`), in order, each recorded in the ledger `held` as soon as it
    finishes (the runs it holds are not trained). With `group_runs`, the unfinished runs that differ only
    in seed and stand at the same checkpoint step are first trained together, one compiled step for all
    (train.run_group); a run with no such partner trains alone."""
    results: dict[str, dict[str, Any]] = {}
    for members in groups([r for r in runs if not (held and held.held(r.config))], workdir) if group_runs else []:
        names = ', '.join(run.name for run in members)
        if len(members) == 1:
            _say(f'{names}: trained alone (no unfinished run of its shape, data and step to group with)')
            continue
        _say(f'{names}: trained together (same shape, data and step; seeds differ)')
        trained = _train(members, workdir, analysis_sequences)
        for run in members:  # recorded now: a grid stopped later keeps this group in its ledger
            results[run.name] = train_or_reuse(run, workdir, analysis_sequences, downstream, trained[run.name], held)
    return [
        results[run.name]
        if run.name in results
        else train_or_reuse(run, workdir, analysis_sequences, downstream, None, held)
        for run in runs
    ]


def from_ledger(runs: list[Run], held: ledger_lib.Ledger) -> list[dict[str, Any]]:
    """Every run's result as the ledger `held` holds it, in order (what the reports are made of);
    GridError naming the runs it lacks."""
    rows = held.rows()
    missing = [run.name for run in runs if ledger_lib.fingerprint(run.config) not in rows]
    if missing:
        raise GridError(
            f"{held.path} holds {len(runs) - len(missing)} of the grid's {len(runs)} runs; missing: "
            f'{", ".join(missing[:5])}{" ..." if len(missing) > 5 else ""}: train them (leave out --report_only), '
            'or add the ledger of the machine that trained them (cat its results.jsonl >> this one).'
        )
    return [ledger_lib.result_of(rows[ledger_lib.fingerprint(run.config)]) for run in runs]


def _say(line: str) -> None:
    """What the grid does with a run, on process 0's terminal: information, not a warning."""
    if jax.process_index() == 0:
        print(line, flush=True)


def groups(runs: list[Run], workdir: epath.Path) -> list[list[Run]]:
    """The unfinished runs by (config but its seed, latest checkpoint step), in first-seen order."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        run_dir = workdir / 'runs' / run.name
        if not (run_dir / 'result.json').exists():
            key = (loop.group_key(run.config), checkpoint.latest_step(run_dir) if run_dir.exists() else None)
            groups.setdefault(key, []).append(run)
    return list(groups.values())


def train_or_reuse(
    run: Run,
    workdir: epath.Path,
    analysis_sequences: int,
    downstream: Downstream | None = None,
    trained: dict[str, Any] | None = None,
    held: ledger_lib.Ledger | None = None,
) -> dict[str, Any]:
    """The run's result: `trained` (from its group), read back if it finished before (its result.json, or
    its row in the ledger `held` where the workdir is gone), else trained (or resumed), evaluated and, with
    analysis_sequences > 0, analysed; then evaluated on the downstream tasks it has no result for; and
    recorded in the ledger."""
    run_dir = workdir / 'runs' / run.name
    result_file = run_dir / 'result.json'
    row = held.held(run.config) if held else None
    reused = trained is None and (result_file.exists() or row is not None)
    if reused and result_file.exists():
        _say(f'{run.name}: finished before, reused')
        result = json.loads(result_file.read_text())
    elif reused:
        _say(f'{run.name}: in the ledger {held.path}, reused')
        result = ledger_lib.result_of(row)
    else:
        result = trained or _train([run], workdir, analysis_sequences)[run.name]
    result.setdefault('downstream', {})
    missing = [t for t in (downstream.tasks if downstream else []) if t not in result['downstream']]
    if missing and not run_dir.exists():
        raise GridError(
            f'{run.name} has no score for {", ".join(missing)} in {held.path} and its workdir {run_dir} is gone: '
            'score it where its workdir is, or train it again (without its ledger row).'
        )
    if missing:
        result['downstream'].update(downstream.metrics(run_dir, missing))
    result = json.loads(json.dumps(result))  # keys as strings, as when read back
    if (missing or not reused) and run_dir.exists() and jax.process_index() == 0:
        result_file.write_text(json.dumps(result))
    if held is not None:
        held.record(run.name, run.config, result)
    return result


def _train(runs: list[Run], workdir: epath.Path, analysis_sequences: int) -> dict[str, dict[str, Any]]:
    """Trains (or resumes) the runs, together if more than one, analyses each, and gathers its numbers
    from metrics.jsonl. Each run's 'seconds' is its share of the wall time its training took over every
    invocation (`training_seconds`; this one's alone for runs from before vrl logged it), and its analysis."""
    started = time.perf_counter()
    run_dirs = [workdir / 'runs' / run.name for run in runs]
    outcomes = loop.run_group([run.config for run in runs], [str(d) for d in run_dirs])
    seconds = (time.perf_counter() - started) / len(runs)
    results = {}
    for run, run_dir, outcome in zip(runs, run_dirs, outcomes):
        if outcome.preempted:
            raise SystemExit(f'{run.name} was preempted and saved; run the same command to resume')
        started = time.perf_counter()
        analysis = analyze.analyze_run(str(run_dir), analysis_sequences, 0, 8) if analysis_sequences else None
        trained = training_seconds(stored.read_metrics(run_dir))
        results[run.name] = _result(
            run,
            run_dir,
            outcome.step,
            (seconds if trained is None else trained) + time.perf_counter() - started,
            analysis,
        )
    return results


def training_seconds(records: list[dict]) -> float | None:
    """The wall seconds a run's training took over all its invocations, its share where it was trained in a
    group: each invocation's last `wall_seconds` over the group's size, summed (an invocation killed
    counts up to its last logged step). None for records from before vrl logged wall_seconds."""
    total, last, group, timed = 0.0, 0.0, 1, False
    for record in records:
        if 'event' in record:
            total, last, group = total + last / group, 0.0, record.get('group_size', 1)
        elif 'wall_seconds' in record:
            last, timed = record['wall_seconds'], True
    return total + last / group if timed else None


def _result(run: Run, run_dir: epath.Path, final_step: int, seconds: float, analysis: dict | None) -> dict[str, Any]:
    """A trained run's numbers, from its metrics."""
    records = read_metrics(run_dir)
    speeds = [r['tokens_per_sec'] for step, r in sorted(records.items()) if 'tokens_per_sec' in r][1:]
    eval_curve = {step: r['eval_loss'] for step, r in sorted(records.items()) if 'eval_loss' in r}
    if final_step not in eval_curve:  # stopped between its last save and its final eval
        raise GridError(
            f'{run_dir} finished training but holds no eval at step {final_step}; remove that '
            'folder to train the run again.'
        )
    cfg = run.config
    account = accounting.account(cfg.model, cfg.data.seq_len)
    curves_of = downstream_curves(records)
    return {
        'variant': run.variant,
        'model': cfg.model.variant_name,
        'seed': run.seed,
        'step': final_step,
        'coordinates': dict(run.coordinates),
        # the final eval (also when the training had finished in an earlier, interrupted invocation)
        'eval_loss': eval_curve[final_step],
        'params': account.params,
        'non_embedding_params': account.non_embedding_params,
        'kv_cache_bytes_per_token': account.kv_cache_bytes_per_token,
        'tokens_per_step': cfg.data.batch_size * cfg.data.seq_len,
        'peak_lr': cfg.optimizer.peak_lr,
        'seq_len': cfg.data.seq_len,
        'flops': account.flops_per_token * cfg.data.batch_size * cfg.data.seq_len * final_step,
        'seconds': seconds,
        'tokens_per_sec': float(np.median(speeds)) if speeds else float('nan'),
        'train_loss': {step: r['loss'] for step, r in records.items() if 'loss' in r},
        'eval_curve': eval_curve,
        'diagnostics': {step: r['diagnostics'] for step, r in sorted(records.items()) if 'diagnostics' in r},
        'analysis': analysis,
        'downstream_curves': curves_of,
        'downstream': scores_at(curves_of, final_step),  # --tasks adds the tasks missing here
    }


def downstream_curves(records: dict[int, dict]) -> dict[str, dict[int, float]]:
    """{'TASK/METRIC': {step: score}} of the tasks scored while training (train.downstream_tasks)."""
    out: dict[str, dict[int, float]] = {}
    for step, record in sorted(records.items()):
        for key, value in record.items():
            if key.startswith('downstream/'):
                out.setdefault(key[len('downstream/') :], {})[step] = value
    return out


def scores_at(curves_of: dict[str, dict[int, float]], step: int) -> dict[str, dict[str, float]]:
    """{task: {metric: score}} at `step` of downstream_curves' curves."""
    scores: dict[str, dict[str, float]] = {}
    for name, curve in curves_of.items():
        if step in curve:
            task, metric = name.split('/', 1)
            scores.setdefault(task, {})[metric] = curve[step]
    return scores


def read_metrics(run_dir: epath.Path) -> dict[int, dict]:
    """A run's metrics by step; a step logged twice (re-run after a resume) keeps its last record."""
    by_step: dict[int, dict] = {}
    for record in stored.read_metrics(run_dir):
        by_step.setdefault(record['step'], {}).update(record)
    return by_step
