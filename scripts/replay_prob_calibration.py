"""Replay: the grown tree over calibrated drafter probabilities, against the raw ones (CPU; issue #5's narrow steps).

python3 scripts/replay_prob_calibration.py R [--window 256] [--budgets 15,31] [--min-count 20]
(R: a `specpilot drafter replay --out R` directory whose candidates/ hold the drafter's top-8 candidates; notes/h200.md,
session 47.) best_first_tree scores a node by the product of its path's drafter probabilities: a block drafter's
per-position marginals, which at depth d also spread mass over what the tokens above could have been. What a tree
node is worth is the chance its token is the target's given its parent's is: q(d, p), fitted here per depth on bins
of the raw probability p (pool-adjacent-violators, so q is monotone in p and siblings keep their order) from the
anchors of the other half of the references (two folds), over every position whose true prefix lies in the
lattice's top 8. Over the EOS-stopped references, each walked as its tree accepts (the gated lookup leading, as
smollm2-135m-h200's narrow steps), it prints draft tokens accepted a step with raw and calibrated scores.
"""
import argparse
import bisect
import collections
from pathlib import Path

from specpilot.costmodel.acceptance import best_first_tree, replay_accepted
from specpilot.drafting.replay import saved_replay
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.drafters.ngram_prefix import LeadGate, led_by_lookup

ap = argparse.ArgumentParser()
ap.add_argument("replay_dir", type=Path)
ap.add_argument("--window", type=int, default=256)
ap.add_argument("--budgets", default="15,31")
ap.add_argument("--min-count", type=int, default=20, help="anchors a bin needs before its own rate counts fully")
args = ap.parse_args()
refs, cands = saved_replay(args.replay_dir, window=args.window)
GATE, DEPTH, WIDTH = LeadGate(2, 0.7), 15, 8
EDGES = [1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]  # bin upper edges
EOS_LIKE = 2000  # outputs shorter than this stopped at EOS (the loops run to 2048)


def pav(rates: list[float], weights: list[float]) -> list[float]:
    """Pool adjacent violators: the non-decreasing sequence closest to `rates` (weighted least squares)."""
    blocks = []  # [value, weight, count]
    for r, w in zip(rates, weights):
        blocks.append([r, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            w = w1 + w2
            blocks.append([(v1 * w1 + v2 * w2) / w if w else (v1 + v2) / 2, w, c1 + c2])
    return [v for v, _, c in blocks for _ in range(c)]


def fit(indices: list[int]):
    """q[d][bin]: the chance a depth-d candidate of raw probability in the bin is the target's token, its true prefix
    in the lattice; a bin with few anchors leans on its raw probability (min_count pseudo-anchors at the bin's
    middle)."""
    hits = collections.Counter()
    seen = collections.Counter()
    psum = collections.Counter()
    for i in indices:
        ref, c = refs[i], cands[i]
        seq = list(ref.prompt) + list(ref.output)
        start = len(ref.prompt)
        T, P = c.tokens[:, :DEPTH, :WIDTH].tolist(), c.probs[:, :DEPTH, :WIDTH].tolist()
        for a in range(start, len(seq) - 1):
            truth = seq[a + 1:a + 1 + DEPTH]
            tok, pr = T[a - start], P[a - start]
            for d, want in enumerate(truth):
                for t, p in zip(tok[d], pr[d]):
                    if p > 0:
                        b = bisect.bisect_left(EDGES, p)
                        seen[d, b] += 1
                        psum[d, b] += p
                        hits[d, b] += t == want
                if want not in tok[d]:
                    break  # the true path leaves the lattice: deeper anchors are unreachable
    q = []
    for d in range(DEPTH):
        rates, weights = [], []
        for b in range(len(EDGES) + 1):
            n = seen[d, b]
            mid = psum[d, b] / n if n else (EDGES[b - 1] if b else EDGES[0]) if b < len(EDGES) else 0.97
            k = args.min_count
            rates.append((hits[d, b] + k * mid) / (n + k))
            weights.append(n + k)
        q.append(pav(rates, weights))
    return q


def calibrated(pr: list[list[float]], q) -> list[list[float]]:
    return [[min(1.0, q[d][bisect.bisect_left(EDGES, p)]) if p > 0 else 0.0 for p in row] if d < len(q) else row
            for d, row in enumerate(pr)]


budgets = [int(b) for b in args.budgets.split(",")]
eos = [i for i, r in enumerate(refs) if len(r.output) < EOS_LIKE]
acc = collections.Counter()
steps = collections.Counter()
for fold in (0, 1):
    q = fit([i for i in eos if i % 2 != fold])
    if fold == 0:
        print("fitted q at depths 1, 2, 4, 8 (bins' upper edges " + ", ".join(map(str, EDGES)) + ", 1):")
        for d in (0, 1, 3, 7):
            print(f"  depth {d + 1}: " + " ".join(f"{v:.3f}" for v in q[d]))
    for i in eos:
        if i % 2 != fold:
            continue
        ref, c = refs[i], cands[i]
        seq = list(ref.prompt) + list(ref.output)
        start, end = len(ref.prompt), len(seq) - 1
        T, P = c.tokens[:, :DEPTH, :WIDTH].tolist(), c.probs[:, :DEPTH, :WIDTH].tolist()
        for budget in budgets:
            for kind in ("raw", "calibrated"):
                look, a = NgramDrafter(DEPTH, 8, 2, True), start
                while a < end:
                    ctx, truth = seq[:a + 1], seq[a + 1:a + 1 + DEPTH]
                    pr = P[a - start] if kind == "raw" else calibrated(P[a - start], q)
                    tok, pr = led_by_lookup(look.propose(ctx, DEPTH).tokens, T[a - start], pr, GATE)
                    got = replay_accepted(best_first_tree(tok, pr, budget), truth)
                    acc[budget, kind] += got
                    steps[budget, kind] += 1
                    a += min(got + 1, end - a)
print(f"{len(eos)} EOS-stopped references; draft tokens accepted a step (tokens a step = that + 1), steps:")
for (budget, kind), n in sorted(steps.items()):
    print(f"  tree{budget:<3} {kind:>10}: {acc[budget, kind] / n:.3f}  ({n} steps)")
