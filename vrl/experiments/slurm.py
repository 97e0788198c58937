"""A grid's seed groups as one SLURM job array (vrl/experiments/launchers.py): task INDEX runs
`python -m vrl.experiments.grid_job --spec=DIR/jobs/INDEX.json` and logs to DIR/jobs/INDEX.log.

The sbatch script is TEMPLATE (or --slurm_template, a file of your own with the same placeholders), with
the resources of --slurm_partition, --slurm_account, --slurm_time, --slurm_cpus, --slurm_gpus and
--slurm_mem as #SBATCH lines. The job runs this Python (sys.executable) in this directory, with the
submitting environment (sbatch's default --export=ALL), so the cluster's nodes must see both at the
same paths, as they see the workdir. Before anything is submitted, `sbatch --test-only` checks the
script against the cluster (a partition or account it does not have is one line).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from etils import epath

from vrl.experiments.grid import GridError
from vrl.experiments.grid_job import Job

TEMPLATE = """#!/usr/bin/env bash
#SBATCH --job-name={job_name}
#SBATCH --array={array}
#SBATCH --output={log}
#SBATCH --open-mode=append
{options}
cd {cwd}
exec {python} -m vrl.experiments.grid_job --spec={spec}
"""


@dataclasses.dataclass(frozen=True)
class Submitted:
    job_id: str
    indices: list[int]


@dataclasses.dataclass(frozen=True)
class Slurm:
    partition: str = ''
    account: str = ''
    time: str = '4:00:00'
    cpus: int = 0
    gpus: int = 0
    mem: str = ''
    template: str = ''  # a file with TEMPLATE's placeholders; '' = TEMPLATE
    poll_seconds: float = 10.0

    def check(self, workdir: epath.Path) -> None:
        """sbatch on PATH, and the cluster takes the script (`sbatch --test-only`): else one GridError."""
        if shutil.which('sbatch') is None:
            raise GridError(
                '--launcher=slurm: sbatch is not on PATH: run this on a SLURM login node (or install '
                "SLURM's clients: apt-get install slurm-client), or use --launcher=local (nothing was submitted)."
            )
        if self.template and not Path(self.template).is_file():
            raise GridError(f'--slurm_template={self.template} does not exist (nothing was submitted).')
        probe = Job(0, [], workdir / 'jobs')
        tested = subprocess.run(
            ['sbatch', '--test-only'], input=self.script([probe], workdir), capture_output=True, text=True
        )
        if tested.returncode != 0:
            why = (tested.stderr.strip().splitlines() or ['sbatch --test-only failed'])[0].removeprefix(
                'sbatch: error: '
            )
            raise GridError(f'--launcher=slurm: the cluster refuses the job: {why} (nothing was submitted).')

    def script(self, jobs: list[Job], workdir: epath.Path) -> str:
        """The sbatch script of an array of `jobs`."""
        options = [f'#SBATCH --time={self.time}']
        for flag, value in (
            ('partition', self.partition),
            ('account', self.account),
            ('cpus-per-task', self.cpus),
            ('gpus', self.gpus),
            ('mem', self.mem),
        ):
            if value:
                options.append(f'#SBATCH --{flag}={value}')
        text = Path(self.template).read_text() if self.template else TEMPLATE
        folder = workdir / 'jobs'
        return text.format(
            job_name=f'vrl-{workdir.name}',
            array=','.join(str(job.index) for job in jobs),
            log=folder / '%a.log',
            options='\n'.join(options),
            cwd=os.getcwd(),
            python=sys.executable,
            spec=f'{folder}/$SLURM_ARRAY_TASK_ID.json',
        )

    def describe(self, jobs: list[Job], workdir: epath.Path) -> str:
        lines = [f'job {job.index}: {", ".join(run.name for run in job.runs)}' for job in jobs]
        return '\n'.join([f'{len(jobs)} SLURM job(s), one array; sbatch script:', self.script(jobs, workdir), *lines])

    def submit(self, jobs: list[Job], workdir: epath.Path) -> Submitted:
        done = subprocess.run(
            ['sbatch', '--parsable'], input=self.script(jobs, workdir), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise GridError(f'sbatch failed: {" ".join(done.stderr.split())}')
        job_id = done.stdout.strip().split(';')[0]
        print(f'submitted SLURM job array {job_id} ({len(jobs)} job(s): {", ".join(str(j.index) for j in jobs)})')
        return Submitted(job_id, [job.index for job in jobs])

    def wait(self, submitted: Submitted, say: Callable[[str], None]) -> None:
        """Polls squeue every poll_seconds until no task of the array is queued or running; says each
        change of the tasks' states."""
        said = ''
        while True:
            queued = subprocess.run(
                ['squeue', '-h', '-j', submitted.job_id, '-o', '%i %T'], capture_output=True, text=True
            )
            states = sorted(line.split()[1] for line in queued.stdout.splitlines() if line.strip())
            if queued.returncode != 0 and 'Invalid job id' not in queued.stderr:
                raise GridError(f'squeue failed: {" ".join(queued.stderr.split())}')
            if not states:
                return
            summary = ', '.join(f'{states.count(s)} {s.lower()}' for s in sorted(set(states)))
            if summary != said:
                say(f'SLURM job array {submitted.job_id}: {summary}')
                said = summary
            time.sleep(self.poll_seconds)
