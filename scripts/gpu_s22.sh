#!/usr/bin/env bash
# Session 22 on one H200 (random weights): QKV tiles that hold their rotary pairs (norm_gemm._rope_tile_cols)
# against the previous build, whose QKV programs loaded every W row twice (as a column and as a partner).
# 1. the epilogue and codegen tests compiled there (the new tiles' bits equal rmsnorm_linear + rope_kv_write);
# 2. the captured decode step of each build, alternated old / new twice (gpu_step_ab.py with the default PDL
#    spec on both sides: a null A/B, two readings of one build per run), Llama-3-8B and SmolLM2 shapes.
#   OLD=path/to/baseline/snapshot OUT=... bash scripts/gpu_s22.sh     (from the repo root of a snapshot, .gpu/src)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}" "${OLD:?set OLD to the baseline snapshot}"
NEW=$PWD
PYTHONPATH=$NEW python3 -m pytest -q -x tests/test_norm_epilogues.py tests/test_kernel_codegen.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
for round in 1 2; do
  for side in old new; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    for shape in ${SHAPES:-llama3-8b smollm2-135m}; do
      reps=30; [ "$shape" = llama3-8b ] && reps=15
      (cd "$dir" && PYTHONPATH=$dir python3 scripts/gpu_step_ab.py "$OUT/step-$side-$round-$shape.json" --shape "$shape" \
        --grid-dependency wait_then_trigger --contexts "${CONTEXTS:-128,2048}" --tokens "${TOKENS:-1,16}" --rounds 2 \
        --reps "$reps" > "$OUT/step-$side-$round-$shape.txt" 2>&1) || echo "$side $round $shape failed"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys, glob, statistics
rows = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/step-*.json")):
    side, rnd, shape = f.rsplit("/", 1)[1][5:-5].split("-", 2)
    for r in json.load(open(f))["rows"]:
        rows.setdefault((shape, r["context"], r["tokens"]), {}).setdefault(side, []).extend([r["default_ms"], r["table_ms"]])
print("| shape | context | T | old ms | new ms | old/new |\n|---|---|---|---|---|---|")
for (shape, ctx, t), v in sorted(rows.items()):
    o, n = statistics.median(v["old"]), statistics.median(v["new"])
    print(f"| {shape} | {ctx} | {t} | {o:.4f} | {n:.4f} | {o / n:.3f} |")
PY
