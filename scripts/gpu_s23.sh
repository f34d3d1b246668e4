#!/usr/bin/env bash
# Session 23 on one H200 (Llama-3-8B shapes, random weights): do the norm launches (QKV with its rotary epilogue,
# gate_up with its SwiGLU epilogue: 96 and 112 programs on 132 SMs at the defaults) gain from other tiles?
# 1. gpu_gemv_sweep.py over the engine's QKV and gate_up launches (T=1,16, weights rotated through 4 copies);
# 2. captured-step A/Bs against the defaults: the shipped table, and the shipped table with the sweep's best QKV
#    and/or gate_up settings (a sweep's best launch is not always the step's: notes/h200.md, session 22).
# pdl: the captured step with the shipped table on both sides, the large matrices (all of Llama-3-8B's) in PDL mode 2
#   (the successor launches once every program has left its K loop) and prefetching the first lines of their rows
#   that fit a budget (kernels/pdl.py), against plain stream order; budgets in MiB from $BUDGETS (0: no prefetch).
# prenorm: the epilogue and rmsnorm tests compiled there, gpu_norm_bits.py (prenorm's bits), then the captured step
#   with the shipped table against it with prenorm on for QKV, gate_up, both, and those and the LM head.
# check: the HBM read rate and the 8B floor on this machine, and the captured step with and without the shipped table
#   at contexts 128 and 2048 for this build and the one at $OLD.
# attn: T-neutral attention launch variants for the 16-token verify at context 2048, against the shipped 32-row tiles.
# attn2: the bits and per-layer times of 2-warp attention tiles (gpu_attn_tiles.py), and the captured step with the
#   shipped table + 2-warp 32-row tiles at T=16 against the defaults (no table), both contexts.
# pdl-kernel: one 8B projection at a time in its own PDL mode (a kernel table's grid_dependency; mode 2 prefetches
#   the first lines of its rows within the 16 MiB budget), against the shipped table in stream order.
#   OUT=... bash scripts/gpu_s23.sh [sweep|pdl|prenorm|check|attn|attn2|pdl-kernel]   (from the repo root of a snapshot, .gpu/src; PYTHONPATH=$PWD)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
python3 -c "import json, yaml; json.dump(yaml.safe_load(open('specpilot/deployments/llama8b-shape-h200.yaml'))['engine']
['kernel_table'], open('$OUT/shipped.json', 'w'))"
if [ "${1:-sweep}" = check ]; then
  python3 -c "import sys; sys.path.insert(0, 'scripts'); from gpu_profile import hbm_read_gbs
from specpilot.engines.shapes import LLAMA3_8B as L; g = hbm_read_gbs()
print(f'HBM read {g:.0f} GB/s; Llama-3-8B floor {L.step_weight_count() * 2 / g / 1e6:.3f} ms')"
  NEW=$PWD
  for side in old new; do
    dir=$NEW; [ $side = old ] && dir=${OLD:?set OLD to the baseline snapshot}
    (cd "$dir" && PYTHONPATH=$dir python3 scripts/gpu_step_ab.py "$OUT/ab-check-$side.json" --shape llama3-8b \
      --table "$OUT/shipped.json" --contexts 128,2048 --tokens 1,16 --rounds 2 --reps 15 > "$OUT/ab-check-$side.txt" 2>&1) \
      || { echo "check $side failed"; tail -5 "$OUT/ab-check-$side.txt"; }
  done
elif [ "${1:-sweep}" = attn ]; then
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
shipped = dict(tuple(p) for p in json.load(open(f"{out}/shipped.json")))
variants = {"w8": {"tile_rows": 32, "num_warps": 8}, "tpp2": {"tile_rows": 32, "tiles_per_program": 2},
            "st3": {"tile_rows": 32, "num_stages": 3}, "w2": {"tile_rows": 32, "num_warps": 2},
            "st1": {"tile_rows": 32, "num_stages": 1}}
for name, p in variants.items():
    json.dump(list({**shipped, "attention@4096x1024@T16": json.dumps(p)}.items()), open(f"{out}/attn-{name}.json", "w"))
PY
  for v in w8 tpp2 st3 w2 st1; do
    python3 scripts/gpu_step_ab.py "$OUT/ab-attn-$v.json" --shape llama3-8b --base-table "$OUT/shipped.json" \
      --table "$OUT/attn-$v.json" --contexts 2048 --tokens 16 --rounds 2 --reps 15 > "$OUT/ab-attn-$v.txt" 2>&1 \
      || { echo "attn $v failed"; tail -5 "$OUT/ab-attn-$v.txt"; }
  done
elif [ "${1:-sweep}" = attn2 ]; then
  python3 scripts/gpu_attn_tiles.py "$OUT/attn-tiles.json" --tiles 1,1r32,1r32w2,1w2 --contexts 128,2048 \
    > "$OUT/attn-tiles.txt" 2>&1; echo "attn tiles rc=$?"; grep "^|" "$OUT/attn-tiles.txt"
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
shipped = dict(tuple(p) for p in json.load(open(f"{out}/shipped.json")))
json.dump(list({**shipped, "attention@4096x1024@T16": json.dumps({"tile_rows": 32, "num_warps": 2})}.items()),
          open(f"{out}/attn-w2.json", "w"))
PY
  python3 scripts/gpu_step_ab.py "$OUT/ab-attn-w2.json" --shape llama3-8b --table "$OUT/attn-w2.json" \
    --contexts 128,2048 --tokens 1,16 --rounds 2 --reps 15 > "$OUT/ab-attn-w2.txt" 2>&1 || tail -5 "$OUT/ab-attn-w2.txt"
  grep "^|" "$OUT/ab-attn-w2.txt"
elif [ "${1:-sweep}" = pdl-kernel ]; then
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
shipped = dict(tuple(p) for p in json.load(open(f"{out}/shipped.json")))
keys = {"o": "o_proj@4096x4096", "qkv": "qkv@6144x4096", "down": "down@4096x14336", "gate_up": "gate_up@28672x4096"}
variants = {"o2": {"o": 2}, "o1": {"o": 1}, "qkv2": {"qkv": 2}, "down2": {"down": 2}, "gate_up2": {"gate_up": 2},
            "o2-qkv2": {"o": 2, "qkv": 2}}
for name, modes in variants.items():
    pairs = dict(shipped)
    for kernel, mode in modes.items():
        for t in (1, 16):
            key = f"{keys[kernel]}@T{t}"
            pairs[key] = json.dumps({**json.loads(pairs.get(key, "{}")), "grid_dependency": mode})
    json.dump(list(pairs.items()), open(f"{out}/pk-{name}.json", "w"))
PY
  for v in ${VARIANTS:-o2 o1 qkv2 down2 gate_up2 o2-qkv2}; do
    python3 scripts/gpu_step_ab.py "$OUT/ab-pk-$v.json" --shape llama3-8b --base-table "$OUT/shipped.json" \
      --table "$OUT/pk-$v.json" --contexts 128 --tokens 1,16 --rounds 2 --reps 15 > "$OUT/ab-pk-$v.txt" 2>&1 \
      || { echo "pdl-kernel $v failed"; tail -5 "$OUT/ab-pk-$v.txt"; }
  done
elif [ "${1:-sweep}" = prenorm ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_rmsnorm.py tests/test_norm_epilogues.py > "$OUT/tests.txt" 2>&1
  echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
  python3 scripts/gpu_norm_bits.py 2>&1 | tail -2
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
shipped = [tuple(p) for p in json.load(open(f"{out}/shipped.json"))]
keys = {"qkv": "qkv@6144x4096", "gate_up": "gate_up@28672x4096", "lm_head": "lm_head@128256x4096"}
def with_prenorm(*names):
    pairs = dict(shipped)
    for n in names:
        for t in (1, 16):
            key = f"{keys[n]}@T{t}"
            pairs[key] = json.dumps({**json.loads(pairs.get(key, "{}")), "prenorm": True})
    return list(pairs.items())
for name, names in {"qkv": ("qkv",), "gate_up": ("gate_up",), "qkv+gate_up": ("qkv", "gate_up"),
                    "all": ("qkv", "gate_up", "lm_head")}.items():
    json.dump(with_prenorm(*names), open(f"{out}/prenorm-{name}.json", "w"))
PY
  for v in ${VARIANTS:-qkv gate_up qkv+gate_up all}; do
    python3 scripts/gpu_step_ab.py "$OUT/ab-prenorm-$v.json" --shape llama3-8b --base-table "$OUT/shipped.json" \
      --table "$OUT/prenorm-$v.json" --contexts "${CONTEXTS:-128}" --tokens 1,16 --rounds 2 --reps 15 \
      > "$OUT/ab-prenorm-$v.txt" 2>&1 || { echo "prenorm $v failed"; tail -5 "$OUT/ab-prenorm-$v.txt"; }
  done
elif [ "${1:-sweep}" = pdl ]; then
  for mib in ${BUDGETS:-0 4 16 48}; do
    python3 scripts/gpu_step_ab.py "$OUT/ab-pdl$mib.json" --shape llama3-8b --base-table "$OUT/shipped.json" \
      --grid-dependency "wait_then_trigger:$mib:wait_then_trigger_at_end" --contexts "${CONTEXTS:-128}" --tokens 1,16 \
      --rounds 2 --reps 15 > "$OUT/ab-pdl$mib.txt" 2>&1 || { echo "pdl $mib failed"; tail -5 "$OUT/ab-pdl$mib.txt"; }
  done
else
python3 scripts/gpu_gemv_sweep.py "$OUT/sweep.json" --shape llama8b --tokens 1,16 --kernels "${KERNELS:-qkv,gate_up}" \
  --block-k "${BLOCK_K:-128,256}" --block-n "${BLOCK_N:-16,32,64,128}" --warps 4,8 --stages "${STAGES:-2,3,4}" --copies 4 \
  > "$OUT/sweep.txt" 2>&1; echo "sweep rc=$?"; grep "^|" "$OUT/sweep.txt"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
shipped = [tuple(p) for p in json.load(open(f"{out}/shipped.json"))]
res = json.load(open(f"{out}/sweep.json"))["results"]
keys = {"qkv": "qkv@6144x4096", "gate_up": "gate_up@28672x4096"}
def best(name):
    pairs = []
    for T, v in res[name]["per_t"].items():
        bk, bn, w, st, sk = (int(x) for x in v["best"].split(","))
        p = {"block_k": bk, "block_n": bn, "num_warps": w, "num_stages": st}
        if sk > 1:
            p["split_k"] = sk
        pairs.append((f"{keys[name]}@T{T}", json.dumps(p)))
    return pairs
def table(*names):
    drop = {keys[n] for n in names}
    return [p for p in shipped if p[0].rsplit("@", 1)[0] not in drop] + [q for n in names for q in best(n)]
variants = {"shipped": shipped}
for n in res:
    variants[f"{n}-best"] = table(n)
if len(res) > 1:
    variants["both-best"] = table(*res)
for name, pairs in variants.items():
    json.dump(pairs, open(f"{out}/table-{name}.json", "w"), indent=0)
    print(name, pairs[-4:])
PY
for t in "$OUT"/table-*.json; do
  v=$(basename "$t" .json); v=${v#table-}
  python3 scripts/gpu_step_ab.py "$OUT/ab-$v.json" --shape llama3-8b --table "$t" --contexts "${CONTEXTS:-128}" \
    --tokens 1,16 --rounds 2 --reps 15 > "$OUT/ab-$v.txt" 2>&1 || echo "a/b $v failed"
done
fi
python3 - "$OUT" <<'PY'
import json, sys, glob, statistics
print("| table | context | T | default ms | table ms | default/table |\n|---|---|---|---|---|---|")
for f in sorted(glob.glob(f"{sys.argv[1]}/ab-*.json")):
    rows = {}
    for r in json.load(open(f))["rows"]:
        rows.setdefault((r["context"], r["tokens"]), []).append((r["default_ms"], r["table_ms"]))
    for (ctx, t), v in sorted(rows.items()):
        d, m = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        print(f"| {f.rsplit('/', 1)[1][3:-5]} | {ctx} | {t} | {d:.4f} | {m:.4f} | {d / m:.3f} |")
PY
