#!/usr/bin/env bash
# Issue #6 on one H200 (random weights), the device plan of notes/h200.md "Session 29":
#   w12   bits (the W12 / oct tests), the Gluon GEMV against the package's W12 and bf16 linear, and the whole
#         Llama-3-8B-shape AR step native vs W12 with the W12 launch defaults of 58b5032       (~5 min)
#   tune  the kernel tuner on a W12 8B build from the default launches, then the step with its table  (~8 min)
#   OUT=... bash scripts/gpu_s30.sh w12|tune   (from the repo root; PYTHONPATH=$PWD)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
case ${1:?w12 or tune} in
  w12)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_weights_w12.py tests/test_weights_oct.py \
      -k "not smollm2" > "$OUT/tests.txt" 2>&1; echo "tests rc=$?: $(tail -1 "$OUT/tests.txt")"
    timeout 180 python3 scripts/gpu_w12_gluon.py "$OUT/gluon.json" 2>&1 | grep -v Warn | tail -48
    timeout 200 python3 scripts/gpu_profile.py "$OUT/prof" --shapes llama8b --weight-formats native,w12 --tokens 64 \
      2>&1 | grep -v Warn | tail -4 ;;
  tune)  # needs duckdb and the prompts (carry .whl/duck .tb/benchmarks): the tuner's stages read both
    [ -d /tmp/site/duckdb ] || pip install -q --no-index --no-deps --target /tmp/site .whl/duck/*.whl
    export PYTHONPATH="$PWD:/tmp/site" SPECPILOT_BENCHMARKS="$PWD/.tb/benchmarks"
    timeout 420 python3 scripts/gpu_kernel_tuning.py "$OUT/kt" --weight-format w12 --from-defaults \
      --budget '{"max_kernels": 5, "max_settings": 8}' 2>&1 | grep -v Warn | tail -30
    timeout 150 python3 scripts/gpu_profile.py "$OUT/prof-tuned" --shapes llama8b --weight-formats w12 --tokens 64 \
      --kernel-tables "$OUT/kt/summary.json" 2>&1 | grep -v Warn | tail -4 ;;
  *) echo "unknown mode $1" >&2; exit 2 ;;
esac
