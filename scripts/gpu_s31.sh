#!/usr/bin/env bash
# Issue #6 on one H200 (random weights), the device plan of notes/h200.md "Session 30":
#   bits   the W12 / oct / emulated-PTX tests and the kernel tests (max_registers T-neutral), then the W12 linear
#          against bf16 over block_n x stages x split_k x max_registers now that the loads run stages-1 ahead (~9 min)
#   fused  the same sweep for the norm (QKV) and GLU (gate_up) launches, then the whole 8B AR step native vs W12
#          with the W12 launch defaults                                                                      (~8 min)
#   tune   the 8B step native vs W12 at this session's W12 defaults, the kernel tuner on a W12 8B build from them,
#          then the step with its table                                                                       (~9 min)
#   masks  with notes/h200-s31-w12-unmasked-blocks.diff.gz applied (`git apply`; measured, not shipped: whole blocks
#          load without the K predicate, cells without escapes read a shared zero block): bits, the four linears,
#          QKV, gate_up, the 8B step                                                                          (~4 min)
#   OUT=... bash scripts/gpu_s31.sh bits|fused|tune|masks   (from the repo root; PYTHONPATH=$PWD)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
sweep="--block-n 32,64 --stages 2,3,4 --splits 1,4 --warps 4"  # linear at 138 registers (session 30): no cap
case ${1:?bits, fused or tune} in
  bits)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_weights_w12.py tests/test_weights_oct.py \
      tests/test_oct_asm.py tests/test_kernels.py -k "not smollm2" > "$OUT/tests.txt" 2>&1
    echo "tests rc=$?: $(tail -1 "$OUT/tests.txt")"
    timeout 330 python3 scripts/gpu_w12_params.py "$OUT/linear.json" --budget-s 300 $sweep \
      --shapes 128256x4096,4096x4096,14336x4096,4096x14336 2>&1 | grep -v Warn | tail -12 ;;
  fused)
    timeout 130 python3 scripts/gpu_w12_params.py "$OUT/norm.json" --op norm --shapes 6144x4096 --budget-s 110 $sweep --maxnreg 0,168 \
      2>&1 | grep -v Warn | tail -3
    timeout 130 python3 scripts/gpu_w12_params.py "$OUT/glu.json" --op glu --shapes 28672x4096 --budget-s 110 $sweep --maxnreg 0,168 \
      2>&1 | grep -v Warn | tail -3
    timeout 200 python3 scripts/gpu_profile.py "$OUT/prof" --shapes llama8b --weight-formats native,w12 --tokens 64 \
      2>&1 | grep -v Warn | tail -4 ;;
  tune)  # needs duckdb and the prompts (carry .whl/duck .tb/benchmarks): the tuner's stages read both
    [ -d /tmp/site/duckdb ] || pip install -q --no-index --no-deps --target /tmp/site .whl/duck/*.whl
    export PYTHONPATH="$PWD:/tmp/site" SPECPILOT_BENCHMARKS="$PWD/.tb/benchmarks"
    timeout 90 python3 scripts/gpu_profile.py "$OUT/prof" --shapes llama8b --weight-formats native,w12 --tokens 64 \
      2>&1 | grep -v Warn | tail -3  # the W12 defaults of this session (3 stages up to 64 columns)
    timeout 340 python3 scripts/gpu_kernel_tuning.py "$OUT/kt" --weight-format w12 --from-defaults \
      --budget '{"max_kernels": 5, "max_settings": 8}' 2>&1 | grep -v Warn | tail -30
    timeout 120 python3 scripts/gpu_profile.py "$OUT/prof-tuned" --shapes llama8b --weight-formats w12 --tokens 64 \
      --kernel-tables "$OUT/kt/summary.json" 2>&1 | grep -v Warn | tail -4 ;;
  masks)  # the unmasked-blocks diff applied (see above): bits, kernels, the 8B step
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_weights_w12.py tests/test_weights_oct.py \
      tests/test_oct_asm.py -k "not smollm2" > "$OUT/tests.txt" 2>&1; echo "tests rc=$?: $(tail -1 "$OUT/tests.txt")"
    timeout 150 python3 scripts/gpu_w12_params.py "$OUT/linear.json" --budget-s 140 --block-n 32,64 --stages 3 \
      --splits 1,4 --shapes 128256x4096,4096x4096,14336x4096,4096x14336 2>&1 | grep -v Warn | tail -8
    timeout 60 python3 scripts/gpu_w12_params.py "$OUT/norm.json" --op norm --shapes 6144x4096 --budget-s 50 \
      --block-n 64 --stages 2,3 --splits 1,4 --maxnreg 0,168 2>&1 | grep -v Warn | tail -2
    timeout 60 python3 scripts/gpu_w12_params.py "$OUT/glu.json" --op glu --shapes 28672x4096 --budget-s 50 \
      --block-n 64 --stages 2 --splits 1 2>&1 | grep -v Warn | tail -2
    timeout 100 python3 scripts/gpu_profile.py "$OUT/prof" --shapes llama8b --weight-formats native,w12 --tokens 64 \
      2>&1 | grep -v Warn | tail -3 ;;
  *) echo "unknown mode $1" >&2; exit 2 ;;
esac
