"""A real one-node SLURM cluster on 127.0.0.1 for the tests: munged, slurmctld and slurmd from Debian's
slurm-wlm and munge (.ci/run installs them), configured in a temporary folder (no systemd, no cgroups,
no accounting), started and stopped by the `cluster` context manager."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

INSTALL = 'apt-get install -y slurm-wlm munge'
DAEMONS = ('munged', 'slurmctld', 'slurmd')


def missing() -> str | None:
    """Why the cluster cannot start here ('' or None: it can)."""
    absent = [d for d in (*DAEMONS, 'sbatch', 'squeue', 'scancel') if shutil.which(d) is None]
    if absent:
        return f'SLURM is not installed ({", ".join(absent)} missing): {INSTALL}'
    if os.geteuid() != 0:
        return 'the test cluster runs its daemons as root (SlurmUser=root)'
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _config(folder: Path) -> str:
    memory = int(next(line for line in open('/proc/meminfo') if line.startswith('MemTotal')).split()[1]) // 1024
    cpus = len(os.sched_getaffinity(0))
    return '\n'.join(
        [
            'ClusterName=vrltest',
            'SlurmctldHost=localhost(127.0.0.1)',
            f'SlurmctldPort={_free_port()}',
            f'SlurmdPort={_free_port()}',
            'AuthType=auth/munge',
            f'AuthInfo=socket={folder}/munge.sock',
            'CredType=cred/munge',
            'ProctrackType=proctrack/linuxproc',
            'TaskPlugin=task/none',
            'SlurmUser=root',
            'SlurmdUser=root',
            f'StateSaveLocation={folder}/state',
            f'SlurmdSpoolDir={folder}/spool',
            f'SlurmctldPidFile={folder}/slurmctld.pid',
            f'SlurmdPidFile={folder}/slurmd.pid',
            f'SlurmctldLogFile={folder}/slurmctld.log',
            f'SlurmdLogFile={folder}/slurmd.log',
            'SelectType=select/cons_tres',
            'SelectTypeParameters=CR_Core',
            'AccountingStorageType=accounting_storage/none',
            'JobCompType=jobcomp/none',
            'MpiDefault=none',
            'ReturnToService=2',
            'KillWait=5',
            f'NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={max(memory - 1024, 1024)} State=UNKNOWN',
            'PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP',
        ]
    )


@contextlib.contextmanager
def cluster(folder: Path) -> Iterator[dict[str, str]]:
    """The cluster's environment for clients (SLURM_CONF), its daemons running until the block ends."""
    (folder / 'state').mkdir(parents=True)
    (folder / 'spool').mkdir()
    key = folder / 'munge.key'
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (folder / 'slurm.conf').write_text(_config(folder) + '\n')
    env = {**os.environ, 'SLURM_CONF': str(folder / 'slurm.conf')}
    try:
        subprocess.run(
            [
                'munged',
                f'--key-file={key}',
                f'--socket={folder}/munge.sock',
                f'--pid-file={folder}/munged.pid',
                f'--log-file={folder}/munged.log',
                f'--seed-file={folder}/munge.seed',
                '-f',
            ],
            check=True,
        )
        subprocess.run(['slurmctld', '-f', env['SLURM_CONF']], check=True, env=env)
        subprocess.run(['slurmd', '-f', env['SLURM_CONF'], '-N', 'localhost'], check=True, env=env)
        deadline = time.monotonic() + 60
        while 'idle' not in subprocess.run(['sinfo', '-h', '-o', '%T'], capture_output=True, text=True, env=env).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f'the SLURM node did not come up: {(folder / "slurmctld.log").read_text()[-2000:]}')
            time.sleep(0.5)
        yield env
    finally:
        for daemon in reversed(DAEMONS):
            pid_file = folder / f'{daemon}.pid'
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        time.sleep(1)
