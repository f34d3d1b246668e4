#!/usr/bin/env bash
# Session 24 on one H200 (random weights): producer statistics (RMSNormLinearParams.producer_stat, kernels/rmsnorm.py).
# o_proj / down store their rows' 16-column sums of squares and the norm launches after them (QKV, gate_up, LM head)
# read those instead of a pass over all of x before their first W chunk (session 23: the fused QKV launch 21.7 us
# against 15.6 for the plain projection of its matrix; gate_up 59.6 against 55.9).
# 1. tests/test_row_sumsq.py and the norm tests compiled there (bits: T-invariance on the hardware, the engine's
#    verify rows against its AR rows);
# 2. captured-step A/Bs, Llama-3-8B with the shipped table and SmolLM2-135M's shape with its shipped table, against
#    the same table with producer_stat on the QKV, gate_up and LM-head entries ($VARIANTS: all, qkv, gate_up).
#   OUT=... bash scripts/gpu_s24.sh   (from the repo root of a snapshot, .gpu/src; PYTHONPATH=$PWD)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
python3 -m pytest -q -p no:cacheprovider tests/test_row_sumsq.py tests/test_rmsnorm.py tests/test_norm_epilogues.py \
  > "$OUT/tests.txt" 2>&1
echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
for shape in llama3-8b smollm2-135m; do
  dep=llama8b-shape-h200; [ $shape = smollm2-135m ] && dep=smollm2-shape-h200
  python3 -c "import json, yaml; json.dump(yaml.safe_load(open('specpilot/deployments/$dep.yaml'))['engine']
.get('kernel_table', []), open('$OUT/shipped-$shape.json', 'w'))"
  for v in ${VARIANTS:-all qkv gate_up}; do
    kernels=qkv,gate_up,lm_head; [ $v != all ] && kernels=$v
    python3 scripts/table_variant.py "$OUT/stat-$shape-$v.json" --shape $shape --base "$OUT/shipped-$shape.json" \
      --set "$kernels:producer_stat=true" > /dev/null || { echo "table $shape $v failed"; continue; }
    python3 scripts/gpu_step_ab.py "$OUT/ab-stat-$shape-$v.json" --shape $shape --base-table "$OUT/shipped-$shape.json" \
      --table "$OUT/stat-$shape-$v.json" --contexts "${CONTEXTS:-128}" --tokens 1,16 --rounds 2 --reps 15 \
      > "$OUT/ab-stat-$shape-$v.txt" 2>&1 || { echo "ab $shape $v failed"; tail -5 "$OUT/ab-stat-$shape-$v.txt"; }
    echo "## $shape $v"; grep "^| [0-9]" "$OUT/ab-stat-$shape-$v.txt"
  done
done
