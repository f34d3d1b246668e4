#!/usr/bin/env bash
# Session 20 on one H200 (random weights): linear's w_preload and attention's 32-row tiles, both T-neutral.
# 1. GPU tests of both (bits against the 16-row / K-loop kernels), gpu_norm_bits.py (w_preload at real shapes);
# 2. scripts/gpu_attn_tiles.py: split + combine us per layer, 16 vs 32 rows a tile, bits compared;
# 3. captured-step A/Bs (gpu_step_ab.py, default / table): SmolLM2 with the preloaded linears, with 32-row attention
#    at T=16 and 32 (a tree's verify), with both; Llama-3-8B with 32-row attention at T=16 (issue #4's verify16 / AR
#    bar at ctx 2048).
#   OUT=... bash scripts/gpu_s20.sh     (from the repo root of a snapshot, .gpu/src)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD"
python3 -m pytest -q -x tests/test_w_preload.py tests/test_kernels.py -k "preload or attention" > "$OUT/tests.txt" 2>&1
echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
python3 scripts/gpu_norm_bits.py 2>&1 | tail -1
python3 scripts/gpu_attn_tiles.py "$OUT/attn-tiles.json" --tiles 1,1r32 --contexts 128,2048 > "$OUT/attn-tiles.txt" 2>&1
tail -9 "$OUT/attn-tiles.txt"
for spec in ${CASES:-linear-preload-smollm2:smollm2-135m:1,16 attn-rows32-smollm2:smollm2-135m:1,16,32 \
    linear-preload-rows32-smollm2:smollm2-135m:1,16,32 attn-rows32-llama8b:llama3-8b:1,16}; do
  IFS=: read -r name shape tokens <<< "$spec"
  reps=30; [ "$shape" = llama3-8b ] && reps=15
  python3 scripts/gpu_step_ab.py "$OUT/ab-$name.json" --shape "$shape" --table "notes/h200-s20-$name.json" \
    --contexts "${CONTEXTS:-128,2048}" --tokens "$tokens" --rounds "${ROUNDS:-3}" --reps "$reps" \
    > "$OUT/ab-$name.txt" 2>&1
  echo "== $name rc=$?"
  grep -E "^\| [0-9]|Error" "$OUT/ab-$name.txt"
done
