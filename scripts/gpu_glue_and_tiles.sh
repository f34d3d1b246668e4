#!/usr/bin/env bash
# The device loop's glue kernels and attention's tiles_per_program on one H200, in one call (random weights; ~4 min):
# 1. the GPU tests that run them (loop kernels against their references, the device loop's captured graphs against
#    AR for chain / tree / n-gram / lookup-led tree, attention with row tiles in turn against one tile a program);
# 2. scripts/gpu_attn_tiles.py: split + combine us per layer, tiles 1/2/4, both shapes, T = 1 and 16, bits equal;
# 3. scripts/gpu_block_drafter_step.py: kernels per chain + lookup step on the device loop, and its ms per step;
# 4. gpu_step_ab.py with notes/h200-s15-attn-tiles{2,4}-<shape>.json (T=16 entries only): the captured step's gain.
#   OUT=... bash scripts/gpu_glue_and_tiles.sh
# Run from the repo root of a snapshot (.gpu/src). Logs under $OUT; the tables last.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD"
python3 -m pytest -q tests/test_loop_kernels.py tests/test_device_loop.py tests/test_ngram_prefix.py \
  -k "gpu or assemble or commit or bad_inputs" > "$OUT/tests-loop.txt" 2>&1
echo "loop tests rc=$? ($(tail -1 "$OUT/tests-loop.txt"))"
python3 -m pytest -q tests/test_kernels.py tests/test_tree_exact.py -k attention > "$OUT/tests-attn.txt" 2>&1
echo "attention tests rc=$? ($(tail -1 "$OUT/tests-attn.txt"))"
python3 scripts/gpu_attn_tiles.py "$OUT/attn-tiles.json" > "$OUT/attn-tiles.txt" 2>&1
echo "attn tiles rc=$?"
mkdir -p "$OUT/bds"
python3 scripts/gpu_block_drafter_step.py "$OUT/bds" > "$OUT/bds.txt" 2>&1
echo "block drafter step rc=$?"
for tiles in 2 4; do
  for pair in smollm2-135m:smollm2:30 llama3-8b:llama8b:15; do
    IFS=: read -r shape short reps <<< "$pair"
    python3 scripts/gpu_step_ab.py "$OUT/ab-tiles$tiles-$short.json" --shape "$shape" \
      --table "notes/h200-s15-attn-tiles$tiles-$short.json" --contexts 128,2048 --tokens 16 --rounds 3 \
      --reps "$reps" > "$OUT/ab-tiles$tiles-$short.txt" 2>&1
    echo "== tiles $tiles $shape rc=$?"
    grep -E "^\| [0-9]|Error" "$OUT/ab-tiles$tiles-$short.txt"
  done
done
grep -v Warn "$OUT/bds.txt" | grep -E "^\||kernels|^ +[0-9.]+ us" | head -30 | cut -c1-140
tail -14 "$OUT/attn-tiles.txt"
