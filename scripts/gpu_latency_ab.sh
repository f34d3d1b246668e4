#!/usr/bin/env bash
# Latency settings on one H200, in one call: are they bit-neutral there, and is each faster in the captured step?
# 1. scripts/gpu_norm_bits.py (every T-neutral latency setting of the norm launches and linear's early_residual
#    against the defaults, bit for bit, SmolLM2 and Llama-3-8B shapes) and the attention kernel tests on the GPU;
# 2. for each table $TABLES-<name>-<shape>.json named (TABLES: notes/h200-s13 unless set), gpu_step_ab.py at both
#    shapes (default/table > 1:
#    the default is faster; < 1: the table's setting is).
#   OUT=... bash scripts/gpu_latency_ab.sh act-prefetch2 early-residual
#   OUT=... SHAPES=smollm2-135m:smollm2:30 TABLES=notes/h200-s20 bash scripts/gpu_latency_ab.sh w-preload
# Run from the repo root of a snapshot (.gpu/src). Logs under $OUT; the A/B rows last.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD"
python3 scripts/gpu_norm_bits.py 2>&1 | tail -2
python3 -m pytest -q -x tests/test_kernels.py -k "attention" > "$OUT/attention-tests.txt" 2>&1
echo "attention tests rc=$? ($(tail -1 "$OUT/attention-tests.txt"))"
python3 -m pytest -q -x tests/test_w_preload.py > "$OUT/w-preload-tests.txt" 2>&1
echo "w_preload tests rc=$? ($(tail -1 "$OUT/w-preload-tests.txt"))"
for name in "$@"; do
  for pair in ${SHAPES:-smollm2-135m:smollm2:30 llama3-8b:llama8b:15}; do
    IFS=: read -r shape short reps <<< "$pair"
    python3 scripts/gpu_step_ab.py "$OUT/ab-$name-$short.json" --shape "$shape" \
      --table "${TABLES:-notes/h200-s13}-$name-$short.json" --contexts "${CONTEXTS:-128,2048}" --rounds "${ROUNDS:-4}" \
      --reps "$reps" > "$OUT/ab-$name-$short.txt" 2>&1
    echo "== $name $shape rc=$?"
    grep -E "^\| [0-9]|Error" "$OUT/ab-$name-$short.txt"
  done
done
