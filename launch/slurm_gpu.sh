#!/usr/bin/env bash
# Multi-node GPU training under SLURM: one process per GPU, jax.distributed over the allocation.
#
#   launch/slurm_gpu.sh [--dry-run] [--nodes=2] [--gpus_per_node=8] [--partition=P] [--time=24:00:00]
#       [--config=configs/svformer_468m.py] [--workdir=/shared/runs/x] [-- extra vrl.main flags]
#
# Submits an sbatch script in which srun starts nodes x gpus_per_node tasks; each task runs
# vrl.main with --coordinator_address (the first node), --num_processes and --process_id
# (SLURM_PROCID) and sees one GPU. --dry-run prints the sbatch script instead of submitting it.
# Run from the repository root on a shared filesystem with .venv set up (README.md, the install line).
set -euo pipefail

dry_run=0 nodes=2 gpus=8 partition='' time_limit=24:00:00 config=configs/svformer_468m.py workdir=runs/slurm
port=8476 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --nodes=*) nodes=${1#*=} ;;
    --gpus_per_node=*) gpus=${1#*=} ;;
    --partition=*) partition=${1#*=} ;;
    --time=*) time_limit=${1#*=} ;;
    --config=*) config=${1#*=} ;;
    --workdir=*) workdir=${1#*=} ;;
    --port=*) port=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done

script=$(cat <<SBATCH
#!/usr/bin/env bash
#SBATCH --job-name=vrl
#SBATCH --nodes=$nodes
#SBATCH --ntasks-per-node=$gpus
#SBATCH --gpus-per-task=1
#SBATCH --time=$time_limit
${partition:+#SBATCH --partition=$partition}
#SBATCH --output=$workdir/slurm-%j.log
set -euo pipefail
cd "$(pwd)" && . .venv/bin/activate
coordinator=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n 1):$port
srun bash -c 'python -m vrl.main --config=$config --workdir=$workdir \\
  --coordinator_address='"\$coordinator"' --num_processes=\$SLURM_NTASKS --process_id=\$SLURM_PROCID ${extra[*]:-}'
SBATCH
)

if [ "$dry_run" = 1 ]; then
  echo "# would run: sbatch (script below)"
  echo "$script"
else
  mkdir -p "$workdir"
  echo "$script" | sbatch
fi
