#!/usr/bin/env bash
# The test files that build engines or launch kernels, run bare on a GPU host (compiled kernels, no interpreter), one
# line a test in $OUT/bare.txt as they finish (a run cut by its limit still lists what ran): tests that launch kernels
# on CPU tensors must carry the `interpreter` marker (tests/conftest.py skips them there), the rest must pass.
#   OUT=... LIMIT=300 [SITE=dir with duckdb] bash .gpu/src/scripts/gpu_bare_tests.sh [TEST_FILE ...]
# (carry .gpu, .whl/duck and .tb/benchmarks)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_device_loop.py tests/test_engine.py tests/test_batch_lookup.py
  tests/test_hybrid_graphs.py tests/test_tune_kernels.py tests/test_deployments.py tests/test_batch.py)  # the GPU host
# lacks optuna and prefect: test_stages, test_batch_tune and test_flow import them
# the prompt sets, where the call carries .tb/benchmarks (scripts/gpu_prepare.sh): the tests that read them run too
[ -z "${SPECPILOT_BENCHMARKS:-}" ] && [ -d ../../.tb/benchmarks ] && export SPECPILOT_BENCHMARKS=$PWD/../../.tb/benchmarks
PYTHONPATH=${SITE:+$SITE:}$PWD timeout "${LIMIT:-300}" python3 -m pytest -v -p no:cacheprovider --tb=line -m "not slow" "${files[@]}" \
  > "$OUT/bare.txt" 2>&1; echo "bare tests rc=$?"
grep -cE " PASSED" "$OUT/bare.txt" | sed 's/^/passed: /'; grep -cE " SKIPPED" "$OUT/bare.txt" | sed 's/^/skipped: /'
grep -E " FAILED| ERROR" "$OUT/bare.txt" | sed 's/ - .*//' | head -60
