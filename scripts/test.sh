#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite (fast and slow tests; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export PREFECT_SERVER_ANALYTICS_ENABLED=false TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
export SPECPILOT_BENCHMARKS=${SPECPILOT_BENCHMARKS:-$(cd .. && pwd)/shared/benchmarks}
exec python -m pytest -q -p no:cacheprovider "$@"
