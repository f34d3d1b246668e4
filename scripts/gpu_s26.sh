#!/usr/bin/env bash
# Session 26 on one H200 (random weights): o_proj's first W chunk in registers before its PDL wait.
# 1. tests/test_w_preload.py compiled there (a large tile's first chunks preloaded, the K loop over the rest: the bits
#    of the K loop alone);
# 2. the captured step at Llama-3-8B shapes, shipped table vs the same with o_proj in PDL mode 1 (its policy's 16 MB
#    L2 prefetch), mode 1 + w_preload (one 16 KiB chunk in registers, no prefetch), mode 2 + w_preload; context 128.
#   OUT=... bash scripts/gpu_s26.sh   (from the repo root; PYTHONPATH=$PWD)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
python3 -m pytest -q -p no:cacheprovider tests/test_w_preload.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"; grep -E "^FAILED" "$OUT/tests.txt" | head -5 | cut -c1-300
python3 -c "import json, yaml; json.dump(yaml.safe_load(open('specpilot/deployments/llama8b-shape-h200.yaml'))['engine']
.get('kernel_table', []), open('$OUT/shipped.json', 'w'))"
for v in ${VARIANTS:-pdl1 pdl1-pre pdl2-pre}; do
  case $v in
    pdl1) set_="grid_dependency=1" ;;
    pdl1-pre) set_="grid_dependency=1;w_preload=true" ;;
    pdl2-pre) set_="grid_dependency=2;w_preload=true" ;;
  esac
  python3 scripts/table_variant.py "$OUT/$v.json" --shape llama3-8b --base "$OUT/shipped.json" --set "o_proj:$set_" \
    > /dev/null || { echo "table $v failed"; continue; }
  python3 scripts/gpu_step_ab.py "$OUT/ab-$v.json" --shape llama3-8b --base-table "$OUT/shipped.json" \
    --table "$OUT/$v.json" --contexts ${CONTEXTS:-128} --tokens 1,16 --rounds ${ROUNDS:-2} --reps ${REPS:-15} \
    > "$OUT/ab-$v.txt" 2>&1 || tail -5 "$OUT/ab-$v.txt"
  echo "## llama3-8b: shipped (default column) vs + o_proj $set_ (table column)"; grep "^| [0-9]" "$OUT/ab-$v.txt"
done
