"""Replay: a verify shape chosen per step, a wide deep tree where the text runs in loops, the narrow tree elsewhere.

python3 scripts/replay_adaptive_rows.py R [--window 256] [--ar-ms 0.699 --narrow-ms 0.948 --wide-ms 1.124] [--gates
2:0.7] [--costs-from BENCH_JSON --variant LABEL_PART] (R: a `specpilot drafter replay --out R` directory whose
candidates/ hold the drafter's top-8 candidates of drafter_window `--window`; notes/h200.md, sessions 39-40.) Narrow:
the 16-row grown tree led by lookup (width 8, n 2..8). Wide: the 32-row one whose periodic lookup leads up to 31 deep
(lookup_depth 31, lookup_periodic); --wide-budget 47 / 63: a 48- / 64-row wide tree; --deep-budget 63: each rule also
with a third, 64-row deep tree (deep_tree_budget). Rule `>= A`: the engine's narrow_tree_budget with wide_tree_after A
(a step is wide where the step two before accepted at least A draft tokens: what the host knows when it queues an
overlapped 1-step chunk; drafting.replay.replay takes the engine's steps). Speedup per request = AR ms/token x tokens /
the steps' summed costs (the H200's measured ms a step), geometric mean over the requests; `narrow` / `wide`: one shape
throughout.
"""
import argparse
import json
from dataclasses import replace
from pathlib import Path

from specpilot.drafting.replay import LookupPolicy, replay_speedup, saved_replay
from specpilot.engines.drafters.ngram_prefix import LeadGate

ap = argparse.ArgumentParser()
ap.add_argument("replay_dir", type=Path)
ap.add_argument("--window", type=int, default=256)
ap.add_argument("--ar-ms", type=float, default=0.699)
ap.add_argument("--narrow-ms", type=float, default=0.948)
ap.add_argument("--wide-ms", type=float, default=1.124)
ap.add_argument("--wide-budget", type=int, default=31, help="the wide tree's nodes (its lookup leads as deep)")
ap.add_argument("--after", default="4,8,12", help="comma-separated wide_tree_after values to replay")
ap.add_argument("--gates", default="", help="AGREE_TOPK:DOUBT_PROB pairs, e.g. 2:0.7,1:0.5: each `>= A` rule again "
                                            "with the lookup gated so (EngineConfig.lookup_agree_topk, "
                                            "lookup_doubt_prob)")
ap.add_argument("--deep-budget", type=int, default=0, help="a third, deep tree's nodes (EngineConfig.deep_tree_budget; "
                                                         "its lookup leads as deep): each `>= A` rule again with it")
ap.add_argument("--deep-ms", type=float, default=1.5, help="the deep tree's step cost")
ap.add_argument("--deep-after", default="16", help="comma-separated deep_tree_after values to replay")
ap.add_argument("--costs-from", default="", help="a bench.json (specpilot bench --out): AR's ms a step and each verify "
                                                 "shape's (its summary's step_ms_by_verify_rows, fitted over the "
                                                 "requests) of the variant --variant names, instead of the --*-ms")
ap.add_argument("--variant", default="block", help="--costs-from: a substring of the variant's label")
args = ap.parse_args()
if args.costs_from:  # rows = draft nodes + 1: the 15 / WB / DB-node shapes' costs
    summary = json.loads(Path(args.costs_from).read_text())["summary"]
    found = [v for v in summary if args.variant in v and summary[v].get("step_ms_by_verify_rows")]
    if not found:
        raise SystemExit(f"{args.costs_from}: no variant holding {args.variant!r} with per-shape step costs")
    by_rows = {int(k): ms for k, ms in summary[found[0]]["step_ms_by_verify_rows"].items()}
    args.ar_ms = summary["ar"]["verify_ms_per_step"]
    for name, nodes in (("narrow_ms", 15), ("wide_ms", args.wide_budget), ("deep_ms", args.deep_budget)):
        if nodes + 1 in by_rows:
            setattr(args, name, by_rows[nodes + 1])
    print(f"costs from {found[0]}: AR {args.ar_ms:.3f}, narrow {args.narrow_ms:.3f}, wide {args.wide_ms:.3f}, "
          f"deep {args.deep_ms:.3f} ms a step")
refs, cands = saved_replay(args.replay_dir, window=args.window)
WB = args.wide_budget
# Both shapes with the periodic lookup, as one engine config (lookup_periodic) runs them.
WIDE = LookupPolicy(tree_budget=WB, tree_width=8, ngram_min=2, ngram_max=8, lookup_depth=WB, periodic=True)
NARROW = replace(WIDE, tree_budget=15, lookup_depth=15)
RULES = [("narrow", NARROW), ("wide", WIDE)] + [(f">= {a}", replace(WIDE, narrow_tree_budget=15, wide_tree_after=a))
                                               for a in map(int, args.after.split(","))]
DB = args.deep_budget
RULES += [(f"{name}, deep {DB} >= {d}", replace(policy, deep_tree_budget=DB, deep_tree_after=d, lookup_depth=DB))
          for d in map(int, args.deep_after.split(",")) if DB for name, policy in RULES if name.startswith(">=")]
GATES = [LeadGate(int(k), float(p)) for k, p in (g.split(":") for g in args.gates.split(",") if g)]
RULES += [(f"{name}, gated top{g.agree_topk}|p<{g.doubt_prob:.2g}", replace(policy, gate=g))
          for g in GATES for name, policy in RULES if name.startswith(">=")]


def run(policy: LookupPolicy) -> tuple[float, float]:
    """(geometric-mean speedup, mean tokens/step) of one policy over the requests."""
    return replay_speedup(refs, cands, policy, args.ar_ms, {15: args.narrow_ms, WB: args.wide_ms, DB: args.deep_ms})


print("| rule | speedup (geomean) | tokens/step (mean) |\n|---|---|---|")
for name, policy in RULES:
    s, t = run(policy)
    print(f"| {name} | {s:.3f}x | {t:.2f} |", flush=True)
