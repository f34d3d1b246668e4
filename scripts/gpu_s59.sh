#!/usr/bin/env bash
# Session 59, one call, random weights (run from a snapshot, .gpu/src, carrying .gpu; logs under $OUT):
#  1. the 8B AR step against the weight-bandwidth floor on this card (issue #4's bar: <= 1.15x; the H200 was last
#     measured in session 27, 1.20x), native weights with llama8b-shape-h200's shipped table, then W12 (#6: >= 1.2x);
#  2. attention's split width at 8B (split_keys 32, outside the tuner's space; 128) against the shipped 64;
#  3. the compiled-kernel tests of session 58's removals (qk_in_qkv's norm_gemm paths, the fused combine).
#   OUT=... [PARTS="8b w12 attn tests"] [REQUIRE_H200=1] bash .gpu/src/scripts/gpu_s59.sh
# REQUIRE_H200=1 stops after naming the card when it is no H200 (the bars are the H200's; the pool lends either).
# At most 8 files come back from $OUT: the numbers that matter are printed last as well.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PARTS=${PARTS:-8b w12 attn tests}
card=$(nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader); echo "$card"
if [ -n "${REQUIRE_H200:-}" ] && [[ "$card" != *H200* ]]; then echo "not an H200: stopping"; exit 0; fi
python3 -c "import json, yaml; json.dump(yaml.safe_load(open('specpilot/deployments/llama8b-shape-h200.yaml'))['engine']
['kernel_table'], open('$OUT/shipped.json', 'w'))"
timeout 60 python3 -c "import sys; sys.path.insert(0, 'scripts'); from gpu_profile import hbm_read_gbs
from specpilot.engines.shapes import LLAMA3_8B as L; g = hbm_read_gbs()
print(f'HBM read {g:.0f} GB/s; Llama-3-8B floor {L.step_weight_count() * 2 / g / 1e6:.3f} ms')" > "$OUT/floor.txt"
[[ $PARTS == *8b* ]] && timeout 200 python3 scripts/gpu_step_ab.py "$OUT/ab-8b.json" --shape llama3-8b --table "$OUT/shipped.json" \
  --contexts 128,2048 --tokens 1,16 --rounds 2 --reps 15 > "$OUT/ab-8b.txt" 2>&1; echo "8b rc=$?"
[[ $PARTS == *w12* ]] && timeout 120 python3 scripts/gpu_step_ab.py "$OUT/ab-8b-w12.json" --shape llama3-8b --weight-format w12 \
  --table "$OUT/shipped.json" --contexts 128 --tokens 1,16 --rounds 2 --reps 15 > "$OUT/ab-8b-w12.txt" 2>&1
echo "w12 rc=$?"
[[ $PARTS == *attn* ]] && for v in "a32:attention:block_n=32;split_keys=32" "a128:attention:split_keys=128"; do  # attention's split width
  python3 scripts/table_variant.py "$OUT/${v%%:*}.json" --base "$OUT/shipped.json" --set "${v#*:}" > /dev/null
  timeout 110 python3 scripts/gpu_step_ab.py "$OUT/ab-8b-${v%%:*}.json" --shape llama3-8b --base-table \
    "$OUT/shipped.json" --table "$OUT/${v%%:*}.json" --contexts 128,2048 --tokens 1,16 --rounds 2 --reps 15 \
    > "$OUT/ab-8b-${v%%:*}.txt" 2>&1; echo "${v%%:*} rc=$?"
done
[[ $PARTS == *tests* ]] && timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_norm_epilogues.py tests/test_kernels.py \
  -k "not smollm2" > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.txt"
exec 2>/dev/null; cat "$OUT/floor.txt"; echo "native:"; tail -9 "$OUT/ab-8b.txt"; echo "w12:"; tail -5 "$OUT/ab-8b-w12.txt"
for v in a32 a128; do echo "$v (default = shipped):"; tail -9 "$OUT/ab-8b-$v.txt"; done
