#!/usr/bin/env bash
# .gpu/src <- the committed tree (HEAD): what GPU runs execute, untouched by work in progress in the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu/src && mkdir -p .gpu/src && git archive HEAD | tar -x -C .gpu/src
echo "snapshot of $(git rev-parse --short HEAD) in .gpu/src ($(du -sh .gpu/src | cut -f1))"
