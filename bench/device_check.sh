#!/usr/bin/env bash
# On a lent GPU machine (no package registry there): install the wheel folders made here beforehand
# by bench/device_wheels.py and sent with the command (device_wheels/, and device_wheels_eval/ for
# the downstream part), then run every part of the device check into OUT (bench/device_check.py).
# Parts that passed are also kept in device_check_state/, which stays on the machine between
# commands, so the same command again (OUT is a new folder each time) runs only what is left.
#
#   bash bench/device_check.sh OUT [bench/device_check.py flags, e.g. --parts train_468m --again]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/device_check.sh OUT [device_check.py flags]}
shift
if [ ! -d device_wheels ]; then
  echo "error: no device_wheels/ here: make it with \`python bench/device_wheels.py\` and send it with the command" >&2
  exit 1
fi
for folder in device_wheels device_wheels_eval; do
  if [ -d "$folder" ]; then python -m pip install -q --no-index --no-deps "$folder"/*.whl; fi
done
python bench/device_check.py --out "$out" --state device_check_state "$@"
