#!/usr/bin/env bash
# Two drafters on smollm2-135m-h200's fastest tree (its switched 16/32-row line, led by lookup) in one bench call,
# so both face the same AR (a call's AR time varies by a few percent: session 41's 0.696 vs 0.714 ms); 5 benchmarks x
# PPB validate prompts x 2048 tokens. After `gpu_smollm2_real.sh a` twice and a `c` run (its drafter in
# /root/tb/drafter), with d's carry:
#   OUT=... bash .gpu/src/scripts/gpu_drafter_ab.sh [DRAFTER_DIR ...]   (default: /root/tb/drafter and the shipped one)
# ALSO="knob: value, ...": each drafter a second time with those engine knobs added to (or replacing) the line's
# (e.g. ALSO="wide_tree_after: 10"; session 44 measured the lookup gate this way), so a knob's A/B shares the call's
# AR too; several variants separated by ";" (ALSO="deep_tree_budget: 63, lookup_depth: 63; deep_tree_after: 12")
# each run once more.
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
drafters=("$@")
[ ${#drafters[@]} -gt 0 ] || drafters=(/root/tb/drafter "$SRC/specpilot/drafting/shipped/smollm2-135m")
# The tree's settings from the deployment itself (its switched line), so the A/B runs what smollm2-135m-h200 ships.
line() {  # the switched line's engine knobs as a flow mapping's body, with $1 ("knob: value, ...") merged over them
  python3 -c "import json, sys, yaml
d = yaml.safe_load(open('$SRC/specpilot/deployments/smollm2-135m-h200.yaml'))
e = [x['engine'] for x in d['drafters'] if x.get('engine', {}).get('narrow_tree_budget')][0]
print(json.dumps({**e, **(yaml.safe_load('{' + sys.argv[1] + '}') or {})})[1:-1])" "$1"
}
L=$(line "") || { echo "no switched tree in smollm2-135m-h200.yaml"; exit 2; }
VARIANTS=("$L")
IFS=';' read -ra ALSOS <<< "${ALSO:-}"
for a in "${ALSOS[@]}"; do
  [ -z "${a// /}" ] && continue
  LA=$(line "$a") || { echo "ALSO is not a flow mapping's body: $a"; exit 2; }
  VARIANTS+=("$LA")
done
EXTRA=""
for d in "${drafters[@]}"; do
  [ -f "$d/config.json" ] || { echo "no drafter at $d"; exit 2; }
  for v in "${VARIANTS[@]}"; do
    EXTRA="$EXTRA${EXTRA:+
}  - {kind: block, model: {path: $d}, engine: {$v}}"
  done
done
# The deployment's kernel table too (its producer statistics and verify-shape launches: AR 0.62 against 0.69 ms a
# token on an H100); DEP_TABLE= (empty) runs the default launches, as every A/B before session 48 did.
DEP_TABLE=${DEP_TABLE-smollm2-135m-h200} ONLY_EXTRA=1 EXTRA="$EXTRA" PPB=${PPB:-8} bash "$SRC/scripts/gpu_smollm2_real.sh" d
