"""A grid's seed groups as Cloud TPU slices, one per job (vrl/experiments/launchers.py), through
launch/tpu_pod.sh: `create` (a TPU VM, or a queued resource for a multi-slice job), `install` (vrl on
every worker, from --tpu_repo), `job` (`python -m vrl.experiments.grid_job --spec=...` on every
worker: the job's runs train on the whole slice and leave their results in the gs:// workdir) and
`delete`, for every job at once, each job's steps in turn. A job whose slice was preempted ends
without results and is submitted again (a new slice, resuming from the runs' checkpoints).

Nothing here runs on this machine's tests: `describe` (what `--list` prints) gives the exact commands,
which tests/test_study.py checks with tpu_pod.sh's own --dry-run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from etils import epath

from vrl.core import storage
from vrl.experiments.grid import GridError
from vrl.experiments.grid_job import Job

SCRIPT = Path(__file__).resolve().parents[2] / 'launch' / 'tpu_pod.sh'
STEPS = ('create', 'install', 'job', 'delete')


@dataclasses.dataclass(frozen=True)
class TpuSlices:
    zone: str = 'us-west4-a'
    accelerator: str = 'v5litepod-8'
    version: str = 'v2-alpha-tpuv5-lite'
    project: str = ''
    repo: str = ''
    prefix: str = 'vrl-grid'

    def check(self, workdir: epath.Path) -> None:
        """A gs:// workdir (a slice sees nothing else of this machine), gcloud and the repository to install."""
        if not storage.is_remote(workdir):
            raise GridError(
                f'--launcher=tpu: --workdir={workdir} is not on gs://: the TPU slices see only the bucket '
                '(nothing was submitted).'
            )
        if not self.repo:
            raise GridError('--launcher=tpu needs --tpu_repo, the git URL the slices install vrl from.')
        if shutil.which('gcloud') is None:
            raise GridError(
                '--launcher=tpu: gcloud is not on PATH: install the Google Cloud CLI (nothing was submitted).'
            )

    def commands(self, job: Job, dry_run: bool = False) -> list[list[str]]:
        """launch/tpu_pod.sh's invocations for `job`, step by step."""
        common = [
            f'--name={self.prefix}-{job.index}',
            f'--zone={self.zone}',
            f'--accelerator={self.accelerator}',
            f'--version={self.version}',
            *([f'--project={self.project}'] if self.project else []),
            f'--repo={self.repo}',
            f'--spec={job.spec}',
        ]
        return [['bash', str(SCRIPT), *(['--dry-run'] if dry_run else []), step, *common] for step in STEPS]

    def describe(self, jobs: list[Job], workdir: epath.Path) -> str:
        lines = [f'{len(jobs)} TPU slice(s) of {self.accelerator}, one per job, each:']
        for job in jobs:
            lines.append(f'job {job.index}: {", ".join(run.name for run in job.runs)}')
            lines += ['  ' + ' '.join(command) for command in self.commands(job)]
        return '\n'.join(lines)

    def submit(self, jobs: list[Job], workdir: epath.Path) -> list[concurrent.futures.Future]:
        pool = concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix='vrl-tpu-job')
        return [pool.submit(self._run, job) for job in jobs]

    def _run(self, job: Job) -> None:
        """The job's steps in turn, its slice deleted whatever happened (a failed step: no results)."""
        try:
            for command in self.commands(job)[:-1]:
                if subprocess.run(command).returncode != 0:
                    return
        finally:
            subprocess.run(self.commands(job)[-1])

    def wait(self, submitted: list[concurrent.futures.Future], say: Callable[[str], None]) -> None:
        for future in concurrent.futures.as_completed(submitted):
            future.result()
        say(f'{len(submitted)} TPU slice job(s) ended')
