#!/usr/bin/env bash
# Two drafters on the deployment's fastest tree in one bench call, so both face the same AR (a call's AR time varies
# by a few percent between calls: session 41's 0.696 vs 0.714 ms): the switched 16/32-row tree led by lookup, 5
# benchmarks x PPB validate prompts x 2048 tokens. After `gpu_smollm2_real.sh a` twice and a `c` run (its drafter in
# /root/tb/drafter), with d's carry:
#   OUT=... bash .gpu/src/scripts/gpu_drafter_ab.sh [DRAFTER_DIR ...]   (default: /root/tb/drafter and the shipped one)
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
drafters=("$@")
[ ${#drafters[@]} -gt 0 ] || drafters=(/root/tb/drafter "$SRC/specpilot/drafting/shipped/smollm2-135m")
L="verify: tree, tree_budget: 31, tree_width: 8, position_ordered_attention: true, device_tree: per_step,
                                              ngram_prefix: true, ngram_min: 2, ngram_max: 8, device_overlap: true,
                                              device_steps: 1, drafter_window: 256, lookup_depth: 31,
                                              lookup_periodic: true, narrow_tree_budget: 15, wide_tree_after: 8"
EXTRA=""
for d in "${drafters[@]}"; do
  [ -f "$d/config.json" ] || { echo "no drafter at $d"; exit 2; }
  EXTRA="$EXTRA${EXTRA:+
}  - {kind: block, model: {path: $d}, engine: {$L}}"
done
ONLY_EXTRA=1 EXTRA="$EXTRA" PPB=${PPB:-8} bash "$SRC/scripts/gpu_smollm2_real.sh" d
