#!/usr/bin/env bash
# Session 21's plan for one H200 (random weights): where the PDL trigger sits (kernels/pdl.py).
# 1. The codegen tests and the PDL tests compiled there;
# 2. captured-step A/Bs (gpu_step_ab.py, default / variant, both orders):
#    - llama8b-large-at-end: Llama-3-8B's large matrices (over the 16 MB prefetch budget: every projection) launched
#      with PDL, their successor released only after the K loop (WAIT_THEN_TRIGGER_AT_END), against plain stream
#      order (the default): issue #4's AR bar is 1.15x the weight floor (4.68-4.84 ms against 3.80 in session 20);
#    - llama8b-large-wait-then-trigger: the same matrices in mode 1 (the successor released at once): session 6's
#      1.2 ms loss, reproduced or not with today's kernels, beside the variant above;
#    - smollm2-all-at-end: SmolLM2's small launches released at the end instead of at once.
#   OUT=... bash scripts/gpu_s21.sh     (from the repo root of a snapshot, .gpu/src)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD"
python3 -m pytest -q -x tests/test_kernel_codegen.py tests/test_kernels.py -k "pdl or codegen" > "$OUT/tests.txt" 2>&1
echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
for spec in ${CASES:-llama8b-large-at-end:llama3-8b:wait_then_trigger:wait_then_trigger_at_end \
    llama8b-large-wait-then-trigger:llama3-8b:wait_then_trigger:wait_then_trigger \
    smollm2-all-at-end:smollm2-135m:wait_then_trigger_at_end:off}; do
  IFS=: read -r name shape mode large <<< "$spec"
  reps=30; [ "$shape" = llama3-8b ] && reps=15
  python3 scripts/gpu_step_ab.py "$OUT/ab-$name.json" --shape "$shape" --grid-dependency "$mode::$large" \
    --contexts "${CONTEXTS:-128,2048}" --tokens "${TOKENS:-1,16}" --rounds "${ROUNDS:-3}" --reps "$reps" \
    > "$OUT/ab-$name.txt" 2>&1
  echo "== $name rc=$?"
  grep -E "^\| [0-9]|Error" "$OUT/ab-$name.txt"
done
