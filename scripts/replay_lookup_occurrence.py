"""Replay: which earlier occurrence of the context's suffix should lead the tree.

python3 scripts/replay_lookup_occurrence.py R [--ngram-max 8] [--budget 15] [--window 256]
(R: a `specpilot drafter replay --out R` directory whose candidates/ hold the drafter's top-8 candidates, of
drafter_window `--window`; notes/h200.md, sessions 37-38)
The lookup leads with the continuation of the most recent occurrence of the longest suffix (NgramDrafter; `recent`).
Against it: among the last 16 occurrences of the longest suffix (`_longest`) or of every suffix length >= 2
(`_all`), the one whose first 4 tokens the block's candidates rate highest (`agree`: sum of log(p + 1e-3)), or the one
that accepts the most (`oracle`: a bound, it reads the output). The 16-row grown tree (width 8, ngram_min 2) as the
smollm2-135m-h200 deployment runs it; tokens/step, mean and geometric mean over the requests.
"""
import argparse
import math
from collections import defaultdict
from pathlib import Path

from specpilot.drafting.replay import LookupPolicy, accepted_length, saved_replay

ap = argparse.ArgumentParser()
ap.add_argument("replay_dir", type=Path)
ap.add_argument("--ngram-max", type=int, default=8)
ap.add_argument("--budget", type=int, default=15)
ap.add_argument("--window", type=int, default=0, help="the candidates of this drafter_window (0: whole context)")
args = ap.parse_args()
refs, cands = saved_replay(args.replay_dir, window=args.window)
NMIN, NMAX = 2, args.ngram_max
policy = LookupPolicy(tree_budget=args.budget, tree_width=8, ngram_min=NMIN, ngram_max=NMAX)
MODES = ("recent", "agree_longest", "agree_all", "oracle_longest", "oracle_all")


def choose(mode, occurrences, lead_of, tokens, probs, truth):
    """The lead under `mode` from occurrences [(n, start)], longest n first."""
    if not occurrences:
        return []
    longest = occurrences[0][0]
    if mode == "recent":
        return lead_of(max(o for o in occurrences if o[0] == longest))
    pool = occurrences if mode.endswith("_all") else [o for o in occurrences if o[0] == longest]
    if mode.startswith("oracle"):
        return max((lead_of(o) for o in pool),
                   key=lambda lead: accepted_length(lead, tokens, probs, None, policy, truth))

    def agreement(o):
        rated = (dict(zip(tokens[d], probs[d])).get(t, 0.0) for d, t in enumerate(lead_of(o)[:4]))
        return sum(math.log(p + 1e-3) for p in rated), o
    return lead_of(max(pool, key=agreement))


def tokens_per_step(ref, tokens_all, probs_all, mode) -> float:
    seq = list(ref.prompt) + list(ref.output)
    start, end = len(ref.prompt), len(seq) - 1
    depth = len(tokens_all[0])
    index = {n: defaultdict(list) for n in range(NMIN, NMAX + 1)}  # NgramDrafter's: n-grams a token follows
    indexed, a, steps = 0, start, []
    while a < end:  # the context is seq[:a + 1]; its n-grams are indexed over seq[:a] (as NgramDrafter's)
        for e in range(indexed, a):
            for n in range(NMIN, min(NMAX, e) + 1):
                index[n][tuple(seq[e - n:e])].append(e - n)
        indexed = max(indexed, a)
        occurrences = [(n, j) for n in range(min(NMAX, a), NMIN - 1, -1)
                       for j in index[n].get(tuple(seq[a + 1 - n:a + 1]), [])[-16:]]
        truth = seq[a + 1:a + 1 + depth]
        lead = choose(mode, occurrences, lambda o: seq[o[1] + o[0]:min(o[1] + o[0] + depth, a + 1)],
                      tokens_all[a - start], probs_all[a - start], truth)
        accepted = accepted_length(lead, tokens_all[a - start], probs_all[a - start], None, policy, truth)
        steps.append(min(accepted + 1, end - a))
        a += steps[-1]
    return sum(steps) / len(steps)


results = {m: [] for m in MODES}
for ref, c in zip(refs, cands):
    tokens_all, probs_all = c.tokens[:, :, :8].tolist(), c.probs[:, :, :8].tolist()
    for mode in MODES:
        results[mode].append(tokens_per_step(ref, tokens_all, probs_all, mode))
print(f"tree {args.budget} width 8, lookup n>={NMIN} n<={NMAX}, {len(refs)} requests: tokens/step mean / geomean")
for mode, v in results.items():
    print(f"  {mode:15s} {sum(v) / len(v):.3f} / {math.exp(sum(map(math.log, v)) / len(v)):.3f}")
