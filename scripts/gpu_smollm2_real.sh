#!/usr/bin/env bash
# Real SmolLM2-135M-Instruct on an air-gapped H200, in back-to-back warm calls (the host is released after 30 s
# idle, and at most 64 MiB travels per call, checkout included (the shipped drafter is 14 MB of it), so the 98 MB
# GGUF goes in three parts, from scripts/gpu_prepare.sh; see notes/h200.md):
#   a: carry .tb/gguf.part.aa, then .tb/gguf.part.ab      -> parks the parts carried in /root/tb (two calls)
#   b: carry .gpu + .tb/gguf.part.ac + tok + benchmarks    -> convert; AR speed (engine vs transformers);
#      + .whl/gguf-0.19.0-py3-none-any.whl                    n-gram bench (device loop and host loop), 5
#      (not all of .whl: 64 MiB a call)                       benchmarks x 2048 tokens (DEP_TABLE=DEPLOYMENT: the
#                                                             bench's engine and an extra AR mode run that
#                                                             deployment's kernel table; b's bench and d:
#                                                             KT_JSON=FILE a table of [key, params] pairs instead)
#  ar: as b, AR speed only (KT="name=notes/table.json ..." adds the engine with each kernel table); AR_STEPS=N
#      (b, d) sets the deployment engine's ar_steps (AR steps chained a graph, default 4)
#   c: carry .gpu (+ b's on a fresh host: it converts)      -> train the block drafter within DEADLINE s (540;
#                                                             checkpoint to $OUT); INIT=DIR continues a saved
#                                                             drafter (with SEED, default 1: new data; LR: a
#                                                             continuation wants ~1e-4, not the default 1e-3);
#                                                             DATA=DIR
#                                                             trains on a run's saved sequences (no generation;
#                                                             /root/tb/drafter after a c on this host); WINDOW=N
#                                                             trains at drafter_window N, GEN_TOKENS=N generates
#                                                             N tokens a sequence (256); TRAIN_ARGS: more
#                                                             `specpilot drafter train` flags (--free-prompts N)
#   d: carry .gpu (+ b's on a fresh host: it converts)      -> block drafter bench on the device loop: chain, and
#                                                             trees of each budget in BUDGETS (default "15 31"),
#                                                             calibrated static shapes (device_tree: calibrated),
#                                                             each alone and led by prompt lookup (ngram_prefix),
#                                                             the chain also with the lookup gate (GATE_K, GATE_P);
#                                                             GROWN=1 adds each budget's per-step tree (device_tree:
#                                                             per_step) alone, led by lookup (ngram_min 2: the
#                                                             replay's best for trees), and that overlapped at
#                                                             1-step chunks (LOOKUP_MAX=8: also that at width 8
#                                                             with suffixes up to 8 tokens, and each OVERLAP
#                                                             gated chain with them; WINDOW=N: those two again
#                                                             with drafter_window N);
#                                                             HOST=1 adds the host loop (device_steps 1) of the
#                                                             chain and the last tree, TWO_LEVEL=1 two-level,
#                                                             OVERLAP="1 4" the gated chain with device_overlap at
#                                                             those device_steps,
#                                                             EXTRA more drafter lines (@D@: the drafter's path;
#                                                             ONLY_EXTRA=1: those alone);
#                                                             with DRAFTER, else c's
#                                                             (/root/tb/drafter), else the shipped one
#                                                             (specpilot/drafting/shipped)
#   batch: as d's carry (+ .tb/benchmarks)                 -> batched serving, AR vs stock vs each mechanism, c=16/20/24,
#                                                             2048 tokens (scripts/gpu_batch_bench.py; BATCH_ARGS more
#                                                             arguments, e.g. --requests 48 --batch '{...}')
#   e: as b's carry                                         -> convert, W12 vs bf16 AR (tokens, speed), then d
# Run from a snapshot of HEAD (.gpu/src: `bash scripts/gpu_snapshot.sh`), so work in progress never travels.
set -uo pipefail
stage=$1
TB=/root/tb
ROOT=$(pwd)
SRC=$ROOT/.gpu/src
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site:$SRC SPECPILOT_BENCHMARKS=$ROOT/.tb/benchmarks PYTHONUNBUFFERED=1
cd "$SRC"
table_json() {  # DEP_TABLE=DEPLOYMENT (e.g. smollm2-shape-h200): that deployment's kernel table as JSON
  python3 -c "import json, yaml
print(json.dumps(yaml.safe_load(open('specpilot/deployments/$DEP_TABLE.yaml'))['engine']['kernel_table']))"
}
dep_table() {  # the engine line's kernel table: KT_JSON=FILE (a JSON list of [key, params] pairs), else DEP_TABLE's
  if [ -n "${KT_JSON:-}" ]; then echo ", kernel_table: $(python3 -c "import json; print(json.dumps(json.load(open('$KT_JSON'))))")"
  elif [ -n "${DEP_TABLE:-}" ]; then echo ", kernel_table: $(table_json)"; fi
}
dep() {  # dep NAME DRAFTERS_YAML -> a deployment YAML of the converted model
  cat > "$TB/$1.yaml" <<YAML
name: $1
target: {path: $TB/hf}
drafters:
$2
device: {kind: cuda, gpu: H200, count: 1}
regime: {kind: single}
workload: {benchmarks: [gsm8k, humaneval, math500, mbpp, mt_bench], prompts_per_benchmark: ${PPB:-4},
           max_new_tokens: 2048, tune_fraction: 0.5, validate_fraction: 0.5, seed: 0}
engine: {dtype: bfloat16, cuda_graphs: true, max_seq_len: 4096, kernel_backend: triton$(dep_table)${AR_STEPS:+, ar_steps: $AR_STEPS}}
YAML
  echo "$TB/$1.yaml"
}
convert() {  # the parks' parts and this call's, joined, checked against the pinned sha256, converted
  pip install -q --no-deps --no-index --target /tmp/site "$ROOT"/.whl/gguf-*.whl 2>&1 | tail -2
  cp "$ROOT"/.tb/gguf.part.* $TB/ && cat $TB/gguf.part.a[a-c] > $TB/smollm2.gguf
  python3 -c "from pathlib import Path; from specpilot.testbed.fetch import SMOLLM2_135M_SOURCE as s, convert_gguf, verify_gguf
verify_gguf(Path('$TB/smollm2.gguf'), s); convert_gguf('$TB/smollm2.gguf', '$TB/hf')" 2>&1 | tail -2 &&
    cp "$ROOT"/.tb/tok/* $TB/hf/
}
bench_block() {  # chain and tree, device and host loop, with one drafter (see d above), 5 benchmarks x PPB prompts
  local d=${DRAFTER:-$TB/drafter}
  [ -f "$d/config.json" ] || d=$ROOT/specpilot/drafting/shipped/smollm2-135m
  echo "drafter: $d"
  local windows=("")  # the LOOKUP_MAX lines' drafter windows: the whole context, and WINDOW's
  [ -n "${WINDOW:-}" ] && windows+=(", drafter_window: $WINDOW")
  local drafters="  - {kind: block, model: {path: $d}, engine: {verify: chain}}
  - {kind: block, model: {path: $d}, engine: {verify: chain, ngram_prefix: true}}
  - {kind: block, model: {path: $d}, engine: {verify: chain, ngram_prefix: true, lookup_agree_topk: ${GATE_K:-2},
                                              lookup_doubt_prob: ${GATE_P:-0.7}}}" b tree
  for b in ${BUDGETS:-15 31}; do
    tree="verify: tree, tree_budget: $b, position_ordered_attention: true"
    drafters="$drafters
  - {kind: block, model: {path: $d}, engine: {$tree, device_tree: calibrated}}
  - {kind: block, model: {path: $d}, engine: {$tree, device_tree: calibrated, ngram_prefix: true}}"
    [ -n "${GROWN:-}" ] && drafters="$drafters
  - {kind: block, model: {path: $d}, engine: {$tree, device_tree: per_step}}
  - {kind: block, model: {path: $d}, engine: {$tree, device_tree: per_step, ngram_prefix: true, ngram_min: 2}}
  - {kind: block, model: {path: $d}, engine: {$tree, device_tree: per_step, ngram_prefix: true, ngram_min: 2,
                                              device_overlap: true, device_steps: 1}}"
    for w in "${windows[@]}"; do
      [ -n "${GROWN:-}" ] && [ -n "${LOOKUP_MAX:-}" ] && drafters="$drafters
  - {kind: block, model: {path: $d}, engine: {$tree, tree_width: 8, device_tree: per_step, ngram_prefix: true,
                                              ngram_min: 2, ngram_max: $LOOKUP_MAX, device_overlap: true, device_steps: 1$w}}"
    done
  done
  [ -n "${HOST:-}" ] && drafters="$drafters
  - {kind: block, model: {path: $d}, engine: {verify: chain, device_steps: 1}}
  - {kind: block, model: {path: $d}, engine: {$tree, device_steps: 1}}"
  [ -n "${EXTRA:-}" ] && drafters="$drafters
${EXTRA//@D@/$d}"
  for k in ${OVERLAP:-}; do  # the gated chain with device_overlap at device_steps k
    drafters="$drafters
  - {kind: block, model: {path: $d}, engine: {verify: chain, ngram_prefix: true, lookup_agree_topk: ${GATE_K:-2},
                                              lookup_doubt_prob: ${GATE_P:-0.7}, device_overlap: true, device_steps: $k}}"
    for w in "${windows[@]}"; do
      [ -n "${LOOKUP_MAX:-}" ] && drafters="$drafters
  - {kind: block, model: {path: $d}, engine: {verify: chain, ngram_prefix: true, lookup_agree_topk: ${GATE_K:-2},
                                              lookup_doubt_prob: ${GATE_P:-0.7}, device_overlap: true, device_steps: $k,
                                              ngram_max: $LOOKUP_MAX$w}}"
    done
  done
  [ -n "${TWO_LEVEL:-}" ] && drafters="$drafters
  - {kind: block, model: {path: $d}, engine: {verify: two_level, tree_budget: 32, level_one_keep: 16, position_ordered_attention: true}}"
  [ -n "${ONLY_EXTRA:-}" ] && drafters="${EXTRA//@D@/$d}"  # EXTRA's lines alone
  python3 -m specpilot.bench.cli bench --deployment "$(dep block "$drafters")" --out "$OUT/bench_block" \
    > "$OUT/bench_block.txt" 2>&1; echo "bench rc=$?"; tail -30 "$OUT/bench_block.txt"
}
case $stage in
  a)
    mkdir -p $TB && cp "$ROOT"/.tb/gguf.part.* $TB/ && ls $TB ;;
  b)
    convert
    [ -n "${DEP_TABLE:-}" ] && table_json > "$OUT/dep_table.json"
    python3 scripts/gpu_engine_check.py $TB/hf "$OUT/check" --tokens 2048 --modes "${MODES:-torch_graph_t1_fast,triton_graph}" \
      --skip-checks ${DEP_TABLE:+--kernel-table "table=$OUT/dep_table.json"} 2>&1 | grep -v Warning | tail -8
    python3 -m specpilot.bench.cli bench --deployment "$(dep ngram '  - {kind: ngram}
  - {kind: ngram, engine: {device_steps: 1}}')" --out "$OUT/bench_ngram" \
      > "$OUT/bench_ngram.txt" 2>&1; echo "bench rc=$?"; tail -30 "$OUT/bench_ngram.txt" ;;
  ar)  # b's carry; AR speed only: the engine (and with each kernel table of KT="name=file ...") vs transformers
    convert
    python3 scripts/gpu_engine_check.py $TB/hf "$OUT/check" --tokens 2048 --modes triton_graph --skip-checks \
      $(for t in ${KT:-}; do echo --kernel-table "$t"; done) 2>&1 | grep -v Warning | tail -8 ;;
  c)
    [ -f $TB/hf/config.json ] || convert  # a fresh host: needs b's carry
    timeout 590 python3 -m specpilot.drafting.train --target $TB/hf --out $TB/drafter --device cuda \
      --deadline-s ${DEADLINE:-540} --steps ${STEPS:-100000} ${INIT:+--init $INIT --seed ${SEED:-1}} ${DATA:+--data-from $DATA} \
      ${LR:+--lr $LR} ${WINDOW:+--context-window $WINDOW} ${GEN_TOKENS:+--gen-tokens $GEN_TOKENS} ${TRAIN_ARGS:-} \
      > "$OUT/train.txt" 2>&1; echo "train rc=$?"; tr "\r" "\n" < "$OUT/train.txt" | grep -v "^\s*$" | tail -25  # progress bars: timing even on a timeout
    mkdir -p "$OUT/drafter/sequences" && cp $TB/drafter/*.json $TB/drafter/*.safetensors "$OUT/drafter/" &&
      cp $TB/drafter/sequences/* "$OUT/drafter/sequences/" ;;
  e)
    convert
    python3 scripts/gpu_engine_check.py $TB/hf "$OUT/check" --tokens 512 --modes triton_graph,triton_graph_w12 \
      --skip-checks --skip-hf 2>&1 | grep -v Warning | tail -4  # W12 on real weights: the same tokens?
    bench_block ;;
  d)
    [ -f $TB/hf/config.json ] || convert  # a fresh host: needs b's carry
    bench_block ;;
  batch)
    [ -f $TB/hf/config.json ] || convert
    eval "python3 scripts/gpu_batch_bench.py $TB/hf $OUT/batch.json --max-new-tokens ${MAX_NEW:-2048} ${BATCH_ARGS:-}" \
      > "$OUT/batch.txt" 2>&1; echo "batch rc=$?"; grep -v "^c=" "$OUT/batch.txt" | tail -48 ;;
esac
