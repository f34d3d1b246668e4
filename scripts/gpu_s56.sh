#!/usr/bin/env bash
# Session 56 (issue #5): attention's chain tiles at T=128, a one-chain block found by one int64 load a program.
# Here first: bash scripts/gpu_snapshot.sh && bash scripts/gpu_s56.sh tables (writes .gpu/tables/*.json:
#   base   smollm2-135m-h200's table
#   chain  + attention@T128 chain_tiles)
# then on the device, back to back (.gpu carried):
#   one:   (with the first GGUF part) park the part (`a`); the chain-tile tests on the GPU; us a layer of attention
#          with and without chain tiles on a chain at three contexts, through anc (no slots) and on a random tree; the
#          random-target 128-row grown step under both tables (a grown tree there, so mostly per-token programs);
#          writes "chain" to /root/tb/pick when the attention at T=128, 1024 keys gained 10%, else "base"
#   bench: (after `a` with the second part, d's carry) the shipped line against the chain table, 80 requests; skipped
#          when the pick is "base" (PICK=chain forces it)
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  tables)
    V="python3 $SRC/scripts/table_variant.py"
    D=.gpu/tables
    mkdir -p $D
    $V $D/base.json --shape smollm2-135m --deployment smollm2-135m-h200 &&
    $V $D/chain.json --shape smollm2-135m --base $D/base.json --set attention@128:chain_tiles=true ;;
  one)
    bash "$SRC/scripts/gpu_smollm2_real.sh" a
    T=$(cd "$SRC/.." && pwd)/tables
    cd "$SRC" && export PYTHONPATH=$SRC
    nvidia-smi --query-gpu=name --format=csv,noheader
    # QUICK=1: the attention's times alone (device time short: the bench checks every token against AR anyway)
    [ -n "${QUICK:-}" ] || timeout 120 python3 -m pytest -q tests/test_tree_exact.py -k chain_tiles 2>&1 | tail -2
    timeout 90 python3 scripts/gpu_attn_tiles.py $OUT/attn.json --shapes smollm2 --contexts 256,1024,2048 \
      --tokens "$([ -n "${QUICK:-}" ] && echo 16,128 || echo 16,32,64,128)" --slots --tiles 1r32,1r32c 2>&1 | tail -14
    timeout 60 python3 scripts/gpu_attn_tiles.py $OUT/attn_anc.json --shapes smollm2 --contexts 1024 \
      --tokens 128 --tiles 1r32 2>&1 | tail -2  # (a chain's keys in slot order through anc: the same bits)
    timeout 60 python3 scripts/gpu_attn_tiles.py $OUT/attn_random.json --shapes smollm2 --contexts 1024 \
      --tokens 128 --slots --tree random --tiles 1r32,1r32c 2>&1 | tail -2
    [ -n "${QUICK:-}" ] || timeout 120 python3 scripts/gpu_block_drafter_step.py $OUT/step128 \
      --drafter specpilot/drafting/shipped/smollm2-135m --window 256 --sections engine --tree-budget 127 \
      --only "grown per step, device loop x1 overlapped" --tokens 256 --rounds 2 \
      --kernel-table $T/base.json,$T/chain.json 2>&1 | grep "observe and lookup beside"
    python3 - "$OUT/attn.json" <<'PY' | tee /root/tb/pick
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    rows = []
row = next((r for r in rows if r["context"] == 1024 and r["T"] == 128), None)
ok = row is not None and row["equal_1r32c"] and row["us_1r32c"] < 0.9 * row["us_1r32"]
print("chain" if ok else "base")
PY
    ;;
  bench)
    T=$(cd "$SRC/.." && pwd)/tables
    PICK=${PICK:-$(cat /root/tb/pick 2>/dev/null || echo base)}
    [ "$PICK" = chain ] || { echo "bench: chain tiles did not gain in 'one' (pick $PICK): nothing to bench"; exit 0; }
    table() { python3 -c "import json, sys; print('kernel_table: ' + json.dumps(json.load(open(sys.argv[1]))))" "$1"; }
    echo "bench: shipped | chain"
    ALSO="$(table $T/chain.json)" bash "$SRC/scripts/gpu_drafter_ab.sh" \
      "$SRC/specpilot/drafting/shipped/smollm2-135m" ;;
  *) echo "usage: gpu_s56.sh tables|one|bench"; exit 2 ;;
esac
