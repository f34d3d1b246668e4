#!/usr/bin/env bash
# Session 54 (issue #5): the 128-row step's attention chain tiles and projections in 32-row tiles. Kernel tables
# first, here: bash scripts/gpu_s54.sh tables (writes .gpu/tables/*.json from smollm2-135m-h200's table:
#   base   the deployment's table
#   chain  + attention@T128 chain_tiles
#   r128   chain + every projection's T128 entry in 32-row tiles (tile_rows; same columns a program)
#   r128n  r128 with half the columns a program (the T128 programs' count of base)
#   r32w   r128 + the T32 entries in 32-row tiles;  r32  r128n + the T32 entries in 32-row tiles, half the columns)
# then, with .gpu carried (after gpu_snapshot.sh) and the first GGUF part:
#   one:   park the part (`a`); GPU tests of both; us a layer of the attention tiles; the projections' sweep with
#          tile_rows (FULL=1); a random-target 128-row and (FULL=1) 32-row grown step under the tables; writes the
#          fastest table's name
#          to /root/tb/pick (r128 / r128n / r32 / r32w, or chain when no 32-row table gained 0.5%)
#          (QUICK=1: the tests and attention tiles only)
#   bench: (after `a` with the second part, d's carry) the shipped line against chain and against the pick (PICK=NAME: that
#          table instead), 80 requests
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  tables)
    V="python3 $SRC/scripts/table_variant.py"
    S="--shape smollm2-135m"
    D=.gpu/tables
    mkdir -p $D
    P=qkv@128,gate_up@128,o_proj@128,down@128,lm_head@128
    P32=qkv@32,gate_up@32,o_proj@32,down@32,lm_head@32
    $V $D/base.json $S --deployment smollm2-135m-h200 &&
    $V $D/chain.json $S --base $D/base.json --set attention@128:chain_tiles=true &&
    $V $D/r128.json $S --base $D/chain.json --set $P:tile_rows=32 &&
    $V $D/r128n.json $S --base $D/r128.json --set qkv@128,o_proj@128,down@128:block_n=32 --set gate_up@128:block_n=64 &&
    $V $D/r32w.json $S --base $D/r128.json --set $P32:tile_rows=32 &&
    $V $D/r32.json $S --base $D/r128n.json --set $P32:tile_rows=32 --set qkv@32,o_proj@32,down@32:block_n=16 \
      --set gate_up@32:block_n=32 ;;
  one)
    bash "$SRC/scripts/gpu_smollm2_real.sh" a
    T=$(cd "$SRC/.." && pwd)/tables
    cd "$SRC" && export PYTHONPATH=$SRC
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 150 python3 -m pytest -q tests/test_tree_exact.py tests/test_tile_rows.py \
      -k "chain_tiles or block_slots or linear" 2>&1 | tail -3
    timeout 80 python3 scripts/gpu_attn_tiles.py $OUT/attn.json --shapes smollm2 --contexts 1024 --tokens 16,32,128 \
      --slots --tiles 1r32,1r32c 2>&1 | tail -7
    [ -n "${FULL:-}" ] && timeout 100 python3 scripts/gpu_gemv_sweep.py $OUT/sweep.json --shape smollm2 --tokens 32,128 \
      --kernels head_stat,gate_up_stat --block-k 128 --block-n 64,128 --warps 4,8 --stages 3 \
      --tile-rows 16,32 --copies 4 2>&1 | tail -5
    [ -n "${QUICK:-}" ] && exit 0  # (device time: the bench then takes PICK=...)
    G="grown per step, device loop x1 overlapped"
    timeout 150 python3 scripts/gpu_block_drafter_step.py $OUT/step128 --drafter specpilot/drafting/shipped/smollm2-135m \
      --window 256 --sections engine --only "$G" --tree-budget 127 --tokens 256 --rounds 2 \
      --kernel-table $T/base.json,$T/r128.json,$T/r128n.json 2>&1 | tail -7
    [ -n "${FULL:-}" ] && timeout 100 python3 scripts/gpu_block_drafter_step.py $OUT/step32 --drafter specpilot/drafting/shipped/smollm2-135m \
      --window 256 --sections engine --only "$G" --tree-budget 31 --tokens 256 --rounds 2 \
      --kernel-table $T/base.json,$T/r32.json,$T/r32w.json 2>&1 | tail -7
    python3 - "$OUT" <<'EOF' | tee /root/tb/pick
import json, sys
def ms(d):  # the plain overlapped line's ms a step under each table
    try:
        e = json.load(open(f"{sys.argv[1]}/{d}/block_drafter_step.json"))["engine"]
    except (OSError, KeyError, ValueError):
        return {}
    return {k.rsplit("[", 1)[1].rstrip("]"): v["ms_per_step"] for k, v in e.items() if "beside" not in k and "[" in k}
s128, s32 = ms("step128"), ms("step32")
best128 = min((t for t in ("r128", "r128n") if t in s128), key=s128.get, default=None)
best32 = min((t for t in ("r32", "r32w") if t in s32), key=s32.get, default=None)
gain = best128 is not None and s128[best128] < 0.995 * s128.get("base", 1e9)
gain32 = best32 is not None and s32[best32] < 0.995 * s32.get("base", 1e9)
if gain and gain32:  # r32 sits on r128n, r32w on r128: keep the faster T128 columns
    pick = "r32" if best128 == "r128n" else "r32w"
else:
    pick = best128 if gain else best32 if gain32 else "chain"
print(f"# 128 rows {s128}, 32 rows {s32}", file=sys.stderr)
print(pick)
EOF
    ;;
  bench)
    T=$(cd "$SRC/.." && pwd)/tables
    PICK=${PICK:-$(cat /root/tb/pick 2>/dev/null || echo chain)}
    table() { python3 -c "import json, sys; print('kernel_table: ' + json.dumps(json.load(open(sys.argv[1]))))" "$1"; }
    echo "bench: shipped | chain | $PICK"
    ALSO="$(table $T/chain.json); $(table $T/$PICK.json)" bash "$SRC/scripts/gpu_drafter_ab.sh" \
      "$SRC/specpilot/drafting/shipped/smollm2-135m" ;;
  *) echo "usage: gpu_s54.sh tables|one|bench"; exit 2 ;;
esac
