#!/usr/bin/env bash
# Session 39's real-SmolLM2 bench (issue #5): the prompt lookup past the block's depth (lookup_depth) and periodic
# (lookup_periodic) in 32- and 48-row grown trees, against the deployment's 16-row tree, every line
# overlapped 1-step chunks, ngram_max 8, drafter_window 256. After `gpu_smollm2_real.sh a` twice (the GGUF parked),
# with d's carry: OUT=... bash .gpu/src/scripts/gpu_s39.sh   (from the repo root)
set -uo pipefail
L="position_ordered_attention: true, tree_width: 8, device_tree: per_step, ngram_prefix: true, ngram_min: 2,
                                              ngram_max: 8, device_overlap: true, device_steps: 1, drafter_window: 256"
line() { echo "  - {kind: block, model: {path: @D@}, engine: {$1}}"; }
EXTRA="$(line "verify: tree, tree_budget: 15, $L")
$(line "verify: tree, tree_budget: 31, $L, lookup_depth: 31")
$(line "verify: tree, tree_budget: 31, $L, lookup_depth: 31, lookup_periodic: true")
$(line "verify: tree, tree_budget: 47, $L, lookup_depth: 47, lookup_periodic: true")"
ONLY_EXTRA=1 EXTRA="$EXTRA" PPB=${PPB:-8} bash "$(dirname "$0")/gpu_smollm2_real.sh" d
