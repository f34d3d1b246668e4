#!/usr/bin/env bash
# Session 27 on one H200 (random weights, SmolLM2 shapes): is a CUDA-core GEMV (row_tile=1: one token row a program,
# each K chunk's products summed with tl.sum) with its whole W tile in registers before the PDL wait faster than the
# 16-row MMA tile at T=1, as the persistent-kernel probe's GEMV chain (2.5 us a GEMV) suggests against the engine's
# _linear_kernel (4.0 us eager)? row_tile is a reduction-order field: T=16 runs it too (16 programs a column tile).
# Captured step, shipped table vs the same with o_proj and down at:
#   r1pre16  row_tile=1, block_n=16, w_preload, 2 warps      r1pre16w4  the same, 4 warps
#   r1pre32  row_tile=1, block_n=32, w_preload, 4 warps      r1-16      row_tile=1, block_n=16 (K loop), 2 warps
#   OUT=... bash scripts/gpu_s27.sh   (from the repo root; PYTHONPATH=$PWD)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
python3 -c "import json, yaml; json.dump(yaml.safe_load(open('specpilot/deployments/smollm2-shape-h200.yaml'))['engine']
.get('kernel_table', []), open('$OUT/shipped.json', 'w'))"
for v in ${VARIANTS:-r1pre16 r1pre16w4 r1pre32 r1-16}; do
  case $v in
    r1pre16) set_="row_tile=1;block_n=16;w_preload=true;num_warps=2" ;;
    r1pre16w4) set_="row_tile=1;block_n=16;w_preload=true;num_warps=4" ;;
    r1pre32) set_="row_tile=1;block_n=32;w_preload=true;num_warps=4" ;;
    r1-16) set_="row_tile=1;block_n=16;num_warps=2" ;;
  esac
  python3 scripts/table_variant.py "$OUT/$v.json" --shape smollm2-135m --base "$OUT/shipped.json" \
    --set "o_proj,down:$set_" > /dev/null || { echo "table $v failed"; continue; }
  python3 scripts/gpu_step_ab.py "$OUT/ab-$v.json" --shape smollm2-135m --base-table "$OUT/shipped.json" \
    --table "$OUT/$v.json" --contexts ${CONTEXTS:-128} --tokens 1,16 --rounds ${ROUNDS:-2} --reps ${REPS:-15} \
    > "$OUT/ab-$v.txt" 2>&1 || tail -5 "$OUT/ab-$v.txt"
  echo "## smollm2: shipped (default column) vs + o_proj, down $set_ (table column)"; grep "^| [0-9]" "$OUT/ab-$v.txt"
done
