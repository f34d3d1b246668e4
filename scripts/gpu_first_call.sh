#!/usr/bin/env bash
# One warm H200 call that measures what the last session changed without device time left to measure it:
# the row_tile=1 projections against the tensor-core tiles (AR step, verify widths, per-kernel table), attention
# against context length after the grouped combine, and whether batched rows equal single-request rows.
# Run from a snapshot (bash scripts/gpu_snapshot.sh; carry .gpu):
#   bash .gpu/src/scripts/gpu_first_call.sh          (results and logs under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/first-call}
mkdir -p "$OUT"
timeout 240 python3 scripts/gpu_profile.py "$OUT/profile" --shapes smollm2,llama8b --tokens 512 --row-tiles 16,1 \
  > "$OUT/profile.txt" 2>&1; echo "profile rc=$?"
timeout 120 python3 scripts/gpu_attn_context.py "$OUT/attn_context.json" --variants 64:64 --tokens 1900 \
  > "$OUT/attn_context.txt" 2>&1; echo "attn_context rc=$?"
timeout 90 python3 scripts/gpu_batch_debug.py > "$OUT/batch_debug.txt" 2>&1; echo "batch_debug rc=$?"
grep -c "^ok" "$OUT/batch_debug.txt"; grep "^DIFF" "$OUT/batch_debug.txt" | cut -c1-110 | head -6
tail -4 "$OUT/attn_context.txt"
grep "^|" "$OUT/profile.txt"
