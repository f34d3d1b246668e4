#!/usr/bin/env bash
# .gpu/src <- the committed tree (HEAD): what GPU runs execute, untouched by work in progress in the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu/src && mkdir -p .gpu/src && git archive HEAD -- . ':(exclude)specpilot/drafting/shipped' | tar -x -C .gpu/src
# The shipped drafter (14 MB) travels once, in the checkout itself: the snapshot links to it (64 MiB a call).
ln -s ../../../../specpilot/drafting/shipped .gpu/src/specpilot/drafting/shipped
echo "snapshot of $(git rev-parse --short HEAD) in .gpu/src ($(du -sh .gpu/src | cut -f1))"
