#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite (fast and slow tests; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export PREFECT_SERVER_ANALYTICS_ENABLED=false TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
export SPECPILOT_BENCHMARKS=${SPECPILOT_BENCHMARKS:-$(cd .. && pwd)/shared/benchmarks}
# Two workers, one thread each, a test file per worker at a time (its module fixtures built once): on 2 cores the
# suite took 930 s, against about 1800 s in one process (most of it is the single-threaded Triton interpreter).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q -p no:cacheprovider -n "${SPECPILOT_TEST_WORKERS:-2}" --dist loadfile "$@"
