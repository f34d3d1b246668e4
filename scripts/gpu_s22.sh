#!/usr/bin/env bash
# Session 22's plan for one H200 (random weights): W rows asked of L2 before the norm statistic
# (norm_gemm.W_PREFETCH_LINES). A norm + projection launch reads all of x and reduces it before its first W load;
# in Llama-3-8B's QKV launch (96 programs, all resident at once) nothing streams meanwhile: 26 us for 50 MB
# against 12.5 us for o_proj's 33 MB (session 22's gpu_gemv_sweep). A prefetch hint fills L2 with each program's
# first W lines during that time.
# 1. the codegen and kernel tests compiled there (the prefetch's T-neutrality on the GPU);
# 2. captured-step A/Bs (gpu_step_ab.py, default / table, both orders): qkv, gate_up and the LM head with 8, 16 and
#    32 lines a row (Llama-3-8B), SmolLM2's LM head with 16.
#   OUT=... bash scripts/gpu_s22.sh     (from the repo root of a snapshot, .gpu/src)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD"
python3 -m pytest -q -x tests/test_kernel_codegen.py tests/test_kernels.py -k "codegen or prefetch or t_neutral or stat" \
  > "$OUT/tests.txt" 2>&1
echo "tests rc=$? ($(tail -1 "$OUT/tests.txt"))"
for spec in ${CASES:-wpf16-llama8b:llama3-8b wpf32-llama8b:llama3-8b wpf8-llama8b:llama3-8b wpf16-smollm2:smollm2-135m}; do
  IFS=: read -r name shape <<< "$spec"
  reps=30; [ "$shape" = llama3-8b ] && reps=15
  python3 scripts/gpu_step_ab.py "$OUT/ab-$name.json" --shape "$shape" --table "notes/h200-s22-$name.json" \
    --contexts "${CONTEXTS:-128,2048}" --tokens "${TOKENS:-1,16}" --rounds "${ROUNDS:-3}" --reps "$reps" \
    > "$OUT/ab-$name.txt" 2>&1
  echo "== $name rc=$?"
  grep -E "^\| [0-9]|Error" "$OUT/ab-$name.txt"
done
