#!/usr/bin/env bash
# Session 26 on one H200 (random weights): the side-stream L2 prefetch (kernels/l2_prefetch.py).
# 1. its tests compiled there (the side stream forked into the captured graphs; bits equal to the plain build);
# 2. the captured step at Llama-3-8B shapes, shipped table vs the same + o_proj side_prefetch_lines in LINES
#    (default "16 32 64": 2, 4 or all 8 KB of each row: 8, 16 or 33.5 MB at 8B), contexts 128 and 2048.
#   OUT=... bash scripts/gpu_s26.sh [prefetch]   (from the repo root; PYTHONPATH=$PWD)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
python3 -m pytest -q -p no:cacheprovider tests/test_l2_prefetch.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"; grep -E "^FAILED|Error" "$OUT/tests.txt" | head -5 | cut -c1-300
shape=${SHAPE:-llama3-8b}
dep=llama8b-shape-h200; [ $shape = smollm2-135m ] && dep=smollm2-shape-h200
python3 -c "import json, yaml; json.dump(yaml.safe_load(open('specpilot/deployments/$dep.yaml'))['engine']
.get('kernel_table', []), open('$OUT/shipped.json', 'w'))"
for lines in ${LINES:-16 32 64}; do
  python3 scripts/table_variant.py "$OUT/pf$lines.json" --shape $shape --base "$OUT/shipped.json" \
    --set "${KERNELS:-o_proj}:side_prefetch_lines=$lines" > /dev/null || { echo "table $lines failed"; continue; }
  python3 scripts/gpu_step_ab.py "$OUT/ab-pf$lines.json" --shape $shape --base-table "$OUT/shipped.json" \
    --table "$OUT/pf$lines.json" --contexts ${CONTEXTS:-128,2048} --tokens 1,16 --rounds ${ROUNDS:-2} \
    --reps ${REPS:-15} > "$OUT/ab-pf$lines.txt" 2>&1 || tail -5 "$OUT/ab-pf$lines.txt"
  echo "## $shape: shipped (default column) vs + ${KERNELS:-o_proj} side_prefetch_lines=$lines (table column)"
  grep "^| [0-9]" "$OUT/ab-pf$lines.txt"
done
