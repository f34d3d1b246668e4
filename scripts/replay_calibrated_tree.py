"""Replay: best-first trees grown on calibrated probabilities instead of the drafter's own.

python3 scripts/replay_calibrated_tree.py R [--budget 15] [--width 8]   (R: a `specpilot drafter replay --out R`
directory whose candidates/ hold the drafter's top-8 candidates; notes/h200.md, session 37)
A candidate's probability p at depth d becomes the share of candidates in p's bin (half-octave bins of p) at depth d
that equal the output's token there, counted at the depths whose path so far is in the candidate lattice (the only
nodes a tree's verify can accept). Fitted on half of the requests and replayed on the other half (two folds), the
tree led by prompt lookup (ngram_min 2) as the smollm2-135m-h200 deployment runs it. Prints tokens/step (mean and
geometric mean over requests), raw and calibrated, and the calibration table.
"""
import argparse
import math
from pathlib import Path

import torch

from specpilot.drafting.replay import AnchorCandidates, LookupPolicy, replay, saved_replay

ap = argparse.ArgumentParser()
ap.add_argument("replay_dir", type=Path)
ap.add_argument("--budget", type=int, default=15)
ap.add_argument("--width", type=int, default=8)
args = ap.parse_args()
refs, cands = saved_replay(args.replay_dir)
policy = LookupPolicy(lookup=True, ngram_min=2, tree_budget=args.budget, tree_width=args.width)
BINS = 24


data = [(ref, c.tokens[:, :, :args.width].tolist(), c.probs[:, :, :args.width].tolist()) for ref, c in zip(refs, cands)]
depth = len(data[0][1][0])


def prob_bin(p: float) -> int:
    return min(BINS - 1, int(-2 * math.log2(p)))


def fit(idx: list[int]) -> list[list[float]]:
    """calibrated[d][bin]: correct / seen at depth d, one pseudo-hit in two pseudo-counts a bin."""
    hit = [[1.0] * BINS for _ in range(depth)]
    seen = [[2.0] * BINS for _ in range(depth)]
    for i in idx:
        ref, tokens, probs = data[i]
        seq = list(ref.prompt) + list(ref.output)
        for a, (tok_a, prob_a) in enumerate(zip(tokens, probs)):
            truth = seq[len(ref.prompt) + a + 1:len(ref.prompt) + a + 1 + depth]
            for d, want in enumerate(truth):
                for t, p in zip(tok_a[d], prob_a[d]):
                    if p > 0:
                        seen[d][prob_bin(p)] += 1
                        hit[d][prob_bin(p)] += t == want
                if want not in tok_a[d]:
                    break  # no node deeper than d can be accepted
    return [[h / n for h, n in zip(hd, nd)] for hd, nd in zip(hit, seen)]


def tokens_per_step(i: int, calibrated: list[list[float]] | None) -> float:
    """The replay (drafting.replay) of request i, its probabilities mapped through `calibrated` (None: as drafted)."""
    probs = cands[i].probs
    if calibrated is not None:
        bins = (-2 * torch.log2(probs.clamp(min=1e-30))).floor().clamp(0, BINS - 1).long()
        table = torch.tensor(calibrated, dtype=probs.dtype)
        probs = torch.where(probs > 0, table[torch.arange(probs.shape[1])[None, :, None], bins], 0.0)
    steps = replay(refs[i], AnchorCandidates(cands[i].tokens, probs), policy)
    return sum(steps) / len(steps)


n = len(data)
folds = [list(range(0, n, 2)), list(range(1, n, 2))]
raw = [tokens_per_step(i, None) for i in range(n)]
cal = [0.0] * n
for k in (0, 1):
    table = fit(folds[1 - k])
    for i in folds[k]:
        cal[i] = tokens_per_step(i, table)
gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
print(f"tree {args.budget} width {args.width}, lookup n>=2, {n} requests: tokens/step mean / geomean")
print(f"  drafter's probabilities: {sum(raw) / n:.3f} / {gm(raw):.3f}")
print(f"  calibrated (two folds):  {sum(cal) / n:.3f} / {gm(cal):.3f}")
table = fit(list(range(n)))
print("calibration (all requests): depth: P(correct) in bins p >= 2^-0.5, 2^-1, 2^-1.5, ...")
for d in sorted({0, 1, 3, 7, depth - 1}):
    print(f"  {d + 1:2d}: {[round(c, 3) for c in table[d][:10]]}")
