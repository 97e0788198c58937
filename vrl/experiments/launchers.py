"""Where a grid's runs train: here, one group after another (`local`), or as jobs of a scheduler
(`slurm`: vrl/experiments/slurm.py; `tpu`: a Cloud TPU slice per job, vrl/experiments/tpu_slices.py).

A job is a seed group (the unfinished runs that differ only in seed and stand at the same checkpoint
step, which a local grid trains together too), written as DIR/jobs/INDEX.json and run by
`python -m vrl.experiments.grid_job`, which trains them in DIR/runs/ as a local grid would. The command
that submitted the jobs waits for them, polling the scheduler; a job that ends without a result for
each of its runs (failed, preempted, cancelled) is submitted again, up to --resubmit times, and resumes
from its runs' checkpoints. Then the grid goes on as a local one: every run is found finished, recorded
in the ledger and reported. So the workdir must be one the scheduler's nodes see at the same path: a
gs:// bucket, or a shared file system.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Protocol

from absl import flags
from etils import epath

from vrl.core import storage
from vrl.experiments import grid, grid_job, slurm, tpu_slices
from vrl.experiments import ledger as ledger_lib

LAUNCHERS = ('local', 'slurm', 'tpu')
# file systems that every node of a cluster mounts at the same path, by /proc/mounts' type
SHARED_FILE_SYSTEMS = ('nfs', 'nfs4', 'lustre', 'gpfs', 'ceph', 'cephfs', 'beegfs', 'glusterfs', 'fuse.gcsfuse')


class Launcher(Protocol):
    """A scheduler: `check` refuses what it cannot run (one line, before anything is submitted);
    `describe` says what `submit` would do; `submit` starts the jobs and `wait` returns once none of
    them is queued or running."""

    def check(self, workdir: epath.Path) -> None: ...

    def describe(self, jobs: list[grid_job.Job], workdir: epath.Path) -> str: ...

    def submit(self, jobs: list[grid_job.Job], workdir: epath.Path) -> Any: ...

    def wait(self, submitted: Any, say: Callable[[str], None]) -> None: ...


def define_flags() -> dict[str, flags.FlagHolder]:
    """The launcher's flags, shared by vrl.experiments.compare and vrl.experiments.study."""
    return {
        'launcher': flags.DEFINE_enum(
            'launcher',
            'local',
            LAUNCHERS,
            'Where the runs train: here (local), a SLURM job per seed group (slurm), or a Cloud TPU slice '
            'per seed group (tpu).',
        ),
        'resubmit': flags.DEFINE_integer(
            'resubmit', 1, 'How many times a job that ended without its results is submitted again.'
        ),
        'workdir_shared': flags.DEFINE_bool(
            'workdir_shared',
            False,
            "Declare a local --workdir visible at the same path on the scheduler's nodes (a mount vrl "
            'cannot recognise as shared, or a one-node cluster).',
        ),
        'slurm_partition': flags.DEFINE_string('slurm_partition', '', 'sbatch --partition.'),
        'slurm_account': flags.DEFINE_string('slurm_account', '', 'sbatch --account.'),
        'slurm_time': flags.DEFINE_string('slurm_time', '4:00:00', 'sbatch --time, per job.'),
        'slurm_cpus': flags.DEFINE_integer('slurm_cpus', 0, 'sbatch --cpus-per-task (0: the cluster default).'),
        'slurm_gpus': flags.DEFINE_integer('slurm_gpus', 0, 'sbatch --gpus per job (0: none asked for).'),
        'slurm_mem': flags.DEFINE_string('slurm_mem', '', "sbatch --mem, e.g. 32G ('': the cluster default)."),
        'slurm_template': flags.DEFINE_string(
            'slurm_template',
            '',
            'An sbatch script of your own with {job_name} {array} {log} {options} {cwd} {python} {spec} '
            'placeholders (--list prints the default one to start from).',
        ),
        'poll_seconds': flags.DEFINE_float('poll_seconds', 10.0, "How often the scheduler's queue is read."),
        'tpu_zone': flags.DEFINE_string('tpu_zone', 'us-west4-a', 'The zone of the TPU slices (launch/tpu_pod.sh).'),
        'tpu_accelerator': flags.DEFINE_string('tpu_accelerator', 'v5litepod-8', 'The slice type of each job.'),
        'tpu_version': flags.DEFINE_string('tpu_version', 'v2-alpha-tpuv5-lite', 'The TPU VM runtime version.'),
        'tpu_project': flags.DEFINE_string('tpu_project', '', 'The Google Cloud project (gcloud default if empty).'),
        'tpu_repo': flags.DEFINE_string('tpu_repo', '', 'The git URL the slices install vrl from.'),
    }


@dataclasses.dataclass(frozen=True)
class Launching:
    """A grid's non-local launcher with the flags about it."""

    kind: str
    launcher: Launcher
    resubmit: int = 1
    workdir_shared: bool = False

    def check(self, workdir: epath.Path) -> None:
        """GridError in one line, before anything is written or submitted, for what cannot run."""
        if self.resubmit < 0:
            raise grid.GridError(f'--resubmit={self.resubmit} is invalid: allowed integers >= 0.')
        check_visible(workdir, self.kind, self.workdir_shared)
        self.launcher.check(workdir)

    def describe(self, runs: list[grid.Run], workdir: epath.Path, held: ledger_lib.Ledger) -> str:
        """What `train` would submit now (--list)."""
        jobs = jobs_for(runs, workdir, held, write_specs=None)
        return self.launcher.describe(jobs, workdir) if jobs else 'no job to submit: every run is finished'

    def train(
        self,
        runs: list[grid.Run],
        workdir: epath.Path,
        analysis_sequences: int,
        held: ledger_lib.Ledger,
        say: Callable[[str], None] = print,
    ) -> None:
        """The unfinished runs trained as jobs (`run_jobs`); the grid then finds each one finished."""
        jobs = jobs_for(runs, workdir, held, write_specs=analysis_sequences)
        if jobs:
            run_jobs(self.launcher, jobs, workdir, self.resubmit, say)


def from_flags(args: dict[str, flags.FlagHolder]) -> Launching | None:
    """The launcher the flags name; None for local."""
    kind = args['launcher'].value
    if kind == 'local':
        return None
    common = dict(resubmit=args['resubmit'].value, workdir_shared=args['workdir_shared'].value)
    if kind == 'slurm':
        return Launching(kind, _slurm(args), **common)
    return Launching(
        kind,
        tpu_slices.TpuSlices(
            zone=args['tpu_zone'].value,
            accelerator=args['tpu_accelerator'].value,
            version=args['tpu_version'].value,
            project=args['tpu_project'].value,
            repo=args['tpu_repo'].value,
        ),
        **common,
    )


def _slurm(args: dict[str, flags.FlagHolder]) -> Launcher:
    return slurm.Slurm(
        partition=args['slurm_partition'].value,
        account=args['slurm_account'].value,
        time=args['slurm_time'].value,
        cpus=args['slurm_cpus'].value,
        gpus=args['slurm_gpus'].value,
        mem=args['slurm_mem'].value,
        template=args['slurm_template'].value,
        poll_seconds=args['poll_seconds'].value,
    )


def check_visible(workdir: epath.Path, kind: str, declared_shared: bool) -> None:
    """A GridError unless the scheduler's nodes see `workdir`: on an object store, on a shared file
    system (SHARED_FILE_SYSTEMS), or declared so (--workdir_shared)."""
    if storage.is_remote(workdir) or declared_shared:
        return
    mount, kind_of = _mount_of(Path(str(workdir)))
    if kind_of in SHARED_FILE_SYSTEMS:
        return
    raise grid.GridError(
        f"--launcher={kind}: --workdir={workdir} is on this machine's own disk ({kind_of} at {mount}), which "
        "the scheduler's nodes do not see: use a gs:// workdir or one on a shared file system, or pass "
        '--workdir_shared if every node mounts it at this path (nothing was submitted).'
    )


def _mount_of(path: Path) -> tuple[str, str]:
    """(mount point, file-system type) of the longest /proc/mounts entry holding `path`."""
    path = path.resolve() if path.exists() else path.absolute()
    best = ('/', 'unknown')
    try:
        lines = Path('/proc/mounts').read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        _, point, kind, *_ = line.split()
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best[0]):
            best = (point, kind)
    return best


def jobs_for(
    runs: list[grid.Run], workdir: epath.Path, held: ledger_lib.Ledger, write_specs: int | None
) -> list[grid_job.Job]:
    """The seed groups of the runs neither finished nor in the ledger, as jobs; with `write_specs` (the
    analysis sequences per run), their specs written."""
    unfinished = [run for run in runs if not held.held(run.config)]
    folder = workdir / 'jobs'
    jobs = [grid_job.Job(index, members, folder) for index, members in enumerate(grid.groups(unfinished, workdir))]
    if jobs and write_specs is not None and not storage.is_remote(folder):
        folder.mkdir(parents=True, exist_ok=True)
    for job in jobs if write_specs is not None else []:
        storage.write_bytes(job.spec, json.dumps(grid_job.spec(job.runs, workdir, write_specs)).encode())
    return jobs


def run_jobs(
    launcher: Launcher,
    jobs: list[grid_job.Job],
    workdir: epath.Path,
    resubmit: int,
    say: Callable[[str], None] = print,
) -> None:
    """Submits `jobs`, waits for them, and submits again (up to `resubmit` times) those that ended
    without every run's result; GridError naming what is still missing and the jobs' logs."""
    pending = jobs
    for attempt in range(resubmit + 1):
        if not pending:
            return
        submitted = launcher.submit(pending, workdir)
        launcher.wait(submitted, say)
        pending = [job for job in pending if not job.finished(workdir)]
        if pending and attempt < resubmit:
            say(
                f'{len(pending)} job(s) ended without their results (failed, preempted or cancelled): '
                + ', '.join(f'{job.index} ({job.runs[0].name}...)' for job in pending)
                + f'; submitted again ({attempt + 1} of {resubmit}), resuming from their checkpoints'
            )
    if pending:
        raise grid.GridError(
            f'{len(pending)} job(s) ended without their results after {resubmit} resubmission(s): '
            + ', '.join(f'{job.runs[0].name} (log {job.log})' for job in pending)
            + '; fix the cause and run the same command: finished runs are kept.'
        )
