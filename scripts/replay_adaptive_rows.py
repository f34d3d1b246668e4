"""Replay: a verify shape chosen per step, a wide deep tree where the text runs in loops, the narrow tree elsewhere.

python3 scripts/replay_adaptive_rows.py R [--window 256] [--ar-ms 0.699 --narrow-ms 0.948 --wide-ms 1.124]
(R: a `specpilot drafter replay --out R` directory whose candidates/ hold the drafter's top-8 candidates of drafter_window
`--window`; notes/h200.md, session 39.) Narrow: the 16-row grown tree led by lookup (width 8, n 2..8). Wide: the
32-row one whose periodic lookup leads up to 31 deep (lookup_depth 31, lookup_periodic). Rule `lag L >= A`: a step is
wide when the step L before it accepted at least A draft tokens (L = 2: what the host knows when it queues an
overlapped 1-step chunk); `+ match`: and the step's lookup matches (known on the device only). Speedup per request = AR ms/token x tokens / the steps' summed costs (the
H200's measured ms a step, session 39), geometric mean over the requests; `narrow` / `wide`: one shape throughout; --wide-budget 47 / 63: a 48- / 64-row wide tree.
"""
import argparse
import math
from pathlib import Path

from specpilot.drafting.replay import LookupPolicy, accepted_length, saved_replay
from specpilot.engines.drafters.ngram import NgramDrafter

ap = argparse.ArgumentParser()
ap.add_argument("replay_dir", type=Path)
ap.add_argument("--window", type=int, default=256)
ap.add_argument("--ar-ms", type=float, default=0.699)
ap.add_argument("--narrow-ms", type=float, default=0.948)
ap.add_argument("--wide-ms", type=float, default=1.124)
ap.add_argument("--wide-budget", type=int, default=31, help="the wide tree's nodes (its lookup leads as deep)")
ap.add_argument("--rules", default="", help="comma-separated rule names to run (default: all)")
args = ap.parse_args()
refs, cands = saved_replay(args.replay_dir, window=args.window)
NARROW = LookupPolicy(tree_budget=15, tree_width=8, ngram_min=2, ngram_max=8)
WB = args.wide_budget
WIDE = LookupPolicy(tree_budget=WB, tree_width=8, ngram_min=2, ngram_max=8, lookup_depth=WB, periodic=True)
RULES = [("narrow", None), ("wide", None)] + [(f"lag {lag} >= {a}{' + match' * m}", (lag, a, m))
                                               for m in (False, True) for lag in (1, 2) for a in (4, 8, 12)]
RULES = [r for r in RULES if not args.rules or r[0] in args.rules.split(",")]


def run(rule) -> tuple[float, float]:
    """(geometric-mean speedup, mean tokens/step) of one rule over the requests."""
    speedups, per_step = [], []
    for ref, c in zip(refs, cands):
        seq = list(ref.prompt) + list(ref.output)
        start, end = len(ref.prompt), len(seq) - 1
        tokens, probs = c.tokens.tolist(), c.probs.tolist()
        lookup = NgramDrafter(WB, 8, 2, periodic=True)
        a, ms, history = start, 0.0, []
        while a < end:
            lead = lookup.propose(seq[:a + 1], WB).tokens
            name, r = rule
            wide = name == "wide" or r is not None and len(history) >= r[0] and history[-r[0]] >= r[1] and (
                bool(lead) or not r[2])
            policy = WIDE if wide else NARROW
            acc = accepted_length(lead if wide else lead[:15], tokens[a - start], probs[a - start], None, policy,
                                  seq[a + 1:a + WB + 1])
            history.append(acc)
            a += min(acc + 1, end - a)
            ms += args.wide_ms if wide else args.narrow_ms
        speedups.append((end - start) * args.ar_ms / ms)
        per_step.append((end - start) / len(history))
    return math.exp(sum(map(math.log, speedups)) / len(speedups)), sum(per_step) / len(per_step)


print("| rule | speedup (geomean) | tokens/step (mean) |\n|---|---|---|")
for rule in RULES:
    s, t = run(rule)
    print(f"| {rule[0]} | {s:.3f}x | {t:.2f} |", flush=True)
