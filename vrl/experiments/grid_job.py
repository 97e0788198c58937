"""One scheduler job of a grid (vrl/experiments/launchers.py): trains the runs of one job spec.

    python -m vrl.experiments.grid_job --spec=DIR/jobs/3.json

A spec lists runs that differ only in seed (a seed group, trained together as vrl.experiments.compare
and study train them locally) and where their grid is: each run trains (or resumes) in
DIR/runs/<name>/ and leaves its result.json there, exactly as a local grid would. The process that
submitted the job gathers the results into the grid's ledger; a job takes no lock on DIR, only each
run's own workdir lock.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections
from absl import flags
from etils import epath

from vrl.core import cli, storage
from vrl.experiments import grid
from vrl.train.config import Config, from_configdict
from vrl.train.rundir import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Job:
    """A seed group of a grid, as a scheduler runs it: DIR/jobs/INDEX.json, logging to DIR/jobs/INDEX.log."""

    index: int
    runs: list[grid.Run]
    folder: epath.Path  # DIR/jobs

    @property
    def spec(self) -> epath.Path:
        return self.folder / f'{self.index}.json'

    @property
    def log(self) -> epath.Path:
        return self.folder / f'{self.index}.log'

    def finished(self, workdir: epath.Path) -> bool:
        return all((workdir / 'runs' / run.name / 'result.json').exists() for run in self.runs)


def spec(runs: list[grid.Run], workdir: epath.Path, analysis_sequences: int) -> dict[str, Any]:
    """The JSON a job reads: the grid's directory, the analysis to run and each run in full."""
    return {
        'workdir': str(workdir),
        'analysis_sequences': analysis_sequences,
        'runs': [
            {
                'variant': run.variant,
                'seed': run.seed,
                'coordinates': [list(c) for c in run.coordinates],
                'config': workdir_lib.as_json(run.config),
            }
            for run in runs
        ],
    }


def runs_of(record: dict[str, Any]) -> list[grid.Run]:
    """The runs of a job spec."""
    return [
        grid.Run(r['variant'], r['seed'], _config(r['config']), tuple(tuple(c) for c in r['coordinates']))
        for r in record['runs']
    ]


def _config(values: dict[str, Any]) -> Config:
    return from_configdict(ml_collections.ConfigDict(values))


def _define_flags() -> dict:
    return {'spec': flags.DEFINE_string('spec', None, 'The job spec, DIR/jobs/INDEX.json.')}


def main(args: cli.Args) -> None:
    cli.require(args, 'spec')
    cli.enable_compilation_cache()
    record = json.loads(storage.path(args['spec'].value).read_text())
    runs = runs_of(record)
    results = grid.train_all(runs, storage.path(record['workdir']), record['analysis_sequences'])
    for run, result in zip(runs, results):
        print(f'{run.name}: eval loss {result["eval_loss"]:.4f} at step {result["step"]}')


def cli_main() -> None:
    cli.run(main, _define_flags)


if __name__ == '__main__':
    cli_main()
