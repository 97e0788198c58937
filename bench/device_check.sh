#!/usr/bin/env bash
# On a lent GPU machine (no package registry there): install the wheels made here beforehand by
# `python bench/device_wheels.py` and sent with the command (the ignored folder device_wheels/),
# then run every part of the device check into OUT (bench/device_check.py; resumable: run it again
# with the same OUT to go on after a timeout).
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
python -m pip install -q --no-index --no-deps device_wheels/*.whl
python bench/device_check.py --out "$out" "$@"
