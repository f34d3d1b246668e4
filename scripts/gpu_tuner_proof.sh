#!/usr/bin/env bash
# The kernel tuner's end-to-end proof on one H200, for each deployment named: tune (profile, attribute, search,
# step gate, re-profile, attribute again: gpu_kernel_tuning.py), then time the captured step with and without the
# table the tuner kept, interleaved and in both orders (gpu_step_ab.py: a sequential A/B read a table 4% slower
# where interleaving read it 3-5% faster, notes/h200.md session 8).
#   OUT=... bash scripts/gpu_tuner_proof.sh smollm2-shape-h200:smollm2-135m [llama8b-shape-h200:llama3-8b ...]
# FROM_DEFAULTS=1: tune from the default launches, not the deployment's table. Needs the duckdb wheel (carry
# .whl/duck) and the benchmark prompts (carry .tb/benchmarks); run from the repo root of a snapshot (.gpu/src). Logs
# and JSON under $OUT; a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
SITE=${SITE:-/tmp/site}
[ -d "$SITE/duckdb" ] || pip install -q --no-deps --target "$SITE" "${WHEELS:-../../.whl/duck}"/*.whl
export PYTHONPATH="$SITE:$PWD" SPECPILOT_BENCHMARKS="${SPECPILOT_BENCHMARKS:-$(cd ../.. && pwd)/.tb/benchmarks}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
for pair in "$@"; do
  dep=${pair%%:*} shape=${pair##*:}
  python3 scripts/gpu_kernel_tuning.py "$OUT/kt-$dep" --deployment "$dep" ${BUDGET:+--budget "$BUDGET"} ${DUMP:+--dump-stacks-after "$DUMP"} ${FROM_DEFAULTS:+--from-defaults} \
    > "$OUT/kt-$dep.txt" 2>&1; echo "tuner $dep rc=$?"
  grep -E "^\||kernel factor|step gate|dropped|Error" "$OUT/kt-$dep.txt" | tail -40
  python3 scripts/gpu_step_ab.py "$OUT/ab-$dep.json" --shape "$shape" --table "$OUT/kt-$dep/summary.json" \
    --contexts "${CONTEXTS:-128,2048}" --rounds "${ROUNDS:-7}" --reps "${REPS:-30}" > "$OUT/ab-$dep.txt" 2>&1
  echo "a/b $dep rc=$?"
  grep -E "^\||Error" "$OUT/ab-$dep.txt" | tail -20
done
