#!/usr/bin/env bash
# The 2-GPU exploration proof on a host with no network: install the carried wheels (Prefect 3.9.1 and what
# the flow needs beyond the host's torch/triton/transformers image; built here by scripts/gpu_wheelhouse.py
# into .whl/prefect) into a --target dir, then run scripts/gpu_two_explorers.py: a one-round tune of a
# random-weight deployment with 2 explore tasks, one per GPU, on an ephemeral Prefect API, and the timeline.
#
#   bash scripts/gpu_two_explorers.sh [--device cpu] [--trials N] [--max-new-tokens N]
#
# WHEELS (default .whl/prefect) and SITE (default /tmp/site) override the folders; results go to $OUT (the
# device tool's output folder) or /tmp/two-explorers.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl/prefect}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "no wheels in $WHEELS: build them with scripts/gpu_wheelhouse.py where PyPI is reachable" >&2
  exit 2
fi
# --no-deps: the wheelhouse holds exactly what the host lacks; the script below checks every requirement.
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# An ephemeral Prefect API with a fresh database, no telemetry; the device tool's NVLink settings stay as set.
export PREFECT_HOME=${PREFECT_HOME:-$(mktemp -d)} PREFECT_SERVER_ANALYTICS_ENABLED=false
unset PREFECT_API_URL
export CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1
# Prompt sets: ../shared/benchmarks when present, else the two small ones carried with the wheels.
if [ -z "${SPECPILOT_BENCHMARKS:-}" ] && [ ! -d ../shared/benchmarks ] && [ ! -d /work/shared/benchmarks ]; then
  export SPECPILOT_BENCHMARKS="$(cd "$WHEELS" && pwd)/benchmarks"
fi
export SPECPILOT_CACHE=${SPECPILOT_CACHE:-$(mktemp -d)}

left_out=()
[ -f "$WHEELS/left-out.txt" ] && left_out=(--left-out "$WHEELS/left-out.txt")
exec "$PY" scripts/gpu_two_explorers.py --site "$SITE" "${left_out[@]}" "$@"
