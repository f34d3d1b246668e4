#!/usr/bin/env bash
# Issue #5's tree step on one H200 (random SmolLM2 weights), the device plan of notes/h200.md "Session 37":
#   attn  position-ordered attention's launch: (1) the microbench at num_stages:tiles_per_program 2:1 (the default),
#         1:1, 1:2, 2:2, 1:4 (bits of every launch checked against the first, nodes against AR); (2) the engine
#         (AR, the chain, the grown 16-row tree) with kernel tables that set the 16-row attention launch to 1:1,
#         1:2, 2:2 against the defaults. num_stages=1 cross-compiles to 99 registers a thread where 2 takes 168
#         (`python3 scripts/attn_registers.py`), the same dots (tests/test_kernel_codegen.py)          (~5 min)
#   loop  the kernels per step with PDL off (each kernel's own time), then AR at 1..16 steps a graph    (~4 min)
#   OUT=... bash scripts/gpu_s37.sh attn|loop   (from the repo root, e.g. .gpu/src of `bash scripts/gpu_snapshot.sh`)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD
table() {  # table STAGES TILES -> a kernel-table file: SmolLM2's attention at T=16 (and T=1..16: one row tile)
  local f="$OUT/attn_table_$1_$2.json"
  python3 -c "import json; print(json.dumps([['attention@576x192@T16', json.dumps({'block_n': 64, 'split_keys': 64,
    'num_warps': 4, 'num_stages': $1, 'tiles_per_program': $2, 'tile_rows': 16})]]))" > "$f"
  echo "$f"
}
case ${1:?attn or loop} in
  attn)
    python3 scripts/gpu_attn_slots.py --launches 2:1,1:1,1:2,2:2,1:4 > "$OUT/attn_slots.txt" 2>&1
    tail -17 "$OUT/attn_slots.txt"
    for t in default 1_1 1_2 2_2; do
      kt=()
      [ $t != default ] && kt=(--kernel-table "$(table ${t%_*} ${t#*_})")
      python3 scripts/gpu_block_drafter_step.py "$OUT/engine_$t" --tree-budget 15 --sections engine \
        --only "ar,chain device loop x4,grown per step" "${kt[@]}" > "$OUT/engine_$t.txt" 2>&1
      echo "== attention at T=16: $t"; grep "^| " "$OUT/engine_$t.txt" | tail -6
    done ;;
  loop)
    python3 scripts/gpu_block_drafter_step.py "$OUT/loop" --tree-budget 15 --sections loop --grid-dependency off \
      > "$OUT/loop.txt" 2>&1
    python3 scripts/gpu_block_drafter_step.py "$OUT/ar" --sections ar --tokens 2048 > "$OUT/ar.txt" 2>&1
    grep -A12 "kernels," "$OUT/loop.txt" | cut -c1-140; grep "^| " "$OUT/ar.txt" ;;
esac
