#!/usr/bin/env bash
# Session 39's real-SmolLM2 bench (issue #5): the 32-row grown tree with the lookup past the block's depth
# (lookup_depth) and periodic (lookup_periodic), alone and switched per step with the 16-row one (narrow_tree_budget),
# against the deployment's 16-row tree (session 39 ran the first two and 32 / 48 rows without switching), every line
# overlapped 1-step chunks, ngram_max 8, drafter_window 256. After `gpu_smollm2_real.sh a` twice (the GGUF parked),
# with d's carry: OUT=... bash .gpu/src/scripts/gpu_s39.sh   (from the repo root)
set -uo pipefail
L="position_ordered_attention: true, tree_width: 8, device_tree: per_step, ngram_prefix: true, ngram_min: 2,
                                              ngram_max: 8, device_overlap: true, device_steps: 1, drafter_window: 256"
line() { echo "  - {kind: block, model: {path: @D@}, engine: {$1}}"; }
EXTRA="$(line "verify: tree, tree_budget: 15, $L")
$(line "verify: tree, tree_budget: 31, $L, lookup_depth: 31, lookup_periodic: true")
$(line "verify: tree, tree_budget: 31, $L, lookup_depth: 31, lookup_periodic: true, narrow_tree_budget: 15,
                                              wide_tree_after: 8")"
ONLY_EXTRA=1 EXTRA="$EXTRA" PPB=${PPB:-8} bash "$(dirname "$0")/gpu_smollm2_real.sh" d
