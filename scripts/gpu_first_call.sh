#!/usr/bin/env bash
# One warm H200 call, random weights, for what session 4 changed without device time left to measure it:
#  1. W12: the GEMM table at Llama-3-8B shapes (bits equal to bf16? speed at 1 and 16 tokens) and the whole-model
#     AR step with 12-bit weights next to bf16 (its tokens must equal bf16's);
#  2. the kernel tuner's before/after attribution (now timing the engine's kernel variants with weights from HBM)
#     on llama8b-shape-h200 and on a random SmolLM2-shaped deployment;
# Run from a snapshot (bash scripts/gpu_snapshot.sh), carrying .gpu, .whl/prefect (the tuner's stages import the
# memory package, which needs duckdb; the host has none) and .tb/benchmarks (the 8B deployment lists all five):
#   WHEELS=$(cd .whl/prefect && pwd) SPECPILOT_BENCHMARKS=$(cd .tb/benchmarks && pwd) \
#     bash .gpu/src/scripts/gpu_first_call.sh      (logs under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/first-call}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${WHEELS:-.whl/prefect}"/*.whl \
  > "$OUT/pip.txt" 2>&1; echo "wheels rc=$?"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 SPECPILOT_BENCHMARKS=${SPECPILOT_BENCHMARKS:?set it to the prompt sets}
timeout 100 python3 -m specpilot.kernels.w12_tile 1 16 > "$OUT/w12_gemm.txt" 2>&1; echo "w12 gemm rc=$?"
timeout 200 python3 scripts/gpu_profile.py "$OUT/profile" --shapes smollm2,llama8b --tokens 256 \
  --weight-formats native,w12 > "$OUT/profile.txt" 2>&1; echo "profile rc=$?"
cat > "$OUT/smollm2-random.yaml" <<YAML
name: smollm2-random-h200
description: random SmolLM2-135M weights, for kernels and cost only
target: {random: smollm2-135m, seed: 0}
drafters:
  - kind: ngram
device: {kind: cuda, gpu: H200, count: 1}
regime: {kind: single}
workload: {benchmarks: [humaneval, mt_bench], prompts_per_benchmark: 2, max_new_tokens: 64, seed: 0}
engine: {dtype: bfloat16, cuda_graphs: true, max_seq_len: 2048, kernel_backend: triton}
YAML
# (limits: the whole call must stay under the device tool's 600 s)
for run in llama8b-shape-h200:240 "$OUT/smollm2-random.yaml":150; do
  dep=${run%:*}
  tag=$(basename "$dep" .yaml)
  timeout "${run##*:}" python3 scripts/gpu_kernel_tuning.py "$OUT/kt-$tag" --deployment "$dep" > "$OUT/kt-$tag.txt" 2>&1
  echo "kernel tuning $tag rc=$?"
done
rm -rf "$OUT"/kt-*/store  # the stage artifacts stay; the store copies would only double them
tail -12 "$OUT/w12_gemm.txt"
grep "^|" "$OUT/profile.txt"
for f in "$OUT"/kt-*.txt; do head -1 "$f"; grep "^|" "$f" | head -14; done
