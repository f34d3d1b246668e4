"""What a cheaper step or fewer steps would give a bench (CPU, no model): each request's decode time re-costed.

python3 scripts/bench_what_if.py BENCH.json [--costs 16:0.768,32:1.072,128:1.891] [--cut-us 10,20,30] [--fewer 1,2,3]

BENCH.json (or .json.gz): a bench's per-request results (`specpilot bench`'s bench.json: each request's decode time, its steps by
verify rows `shape_hist`, its AR twin's decode time). A request's time is its steps at the fitted cost of their
shape (--costs: ms a step by verify rows, the bench's own fit) plus what that fit leaves of its measured time (the
host, the first step); the speedup over AR is re-costed with the 16-row step --cut-us cheaper, with every shape's
step that much cheaper, or with --fewer percent fewer steps of every shape (better acceptance), and the geometric
mean over requests printed as the bench prints it.
"""
import argparse
import gzip
import json
import math

ap = argparse.ArgumentParser()
ap.add_argument("bench")
ap.add_argument("--costs", default="16:0.768,32:1.072,128:1.891",
                help="ms a step by verify rows (the bench's 'ms a step by verify rows' fit)")
ap.add_argument("--cut-us", default="10,20,25,30,40", help="microseconds off a step")
ap.add_argument("--fewer", default="1,2,3", help="percent fewer steps")
args = ap.parse_args()

costs = {k: float(v) for k, v in (p.split(":") for p in args.costs.split(","))}
reqs = json.load((gzip.open if args.bench.endswith(".gz") else open)(args.bench, "rt"))["requests"]
ar = {(r["benchmark"], r["prompt_id"]): r["decode_s"] * 1e3 for r in reqs if r["variant"] == "ar"}
spec = [r for r in reqs if r["variant"] != "ar"]
if not spec or len(ar) * len({r["variant"] for r in spec}) != len(spec):
    raise SystemExit(f"{args.bench}: want one AR request for each speculative one (one speculative variant)")
missing = {k for r in spec for k in r["shape_hist"]} - set(costs)
if missing:
    raise SystemExit(f"--costs has no cost for verify rows {sorted(missing)}")


def geomean(cut16: float = 0.0, cut_all: float = 0.0, steps: float = 1.0) -> float:
    logs = []
    for r in spec:
        fitted = sum(n * costs[k] for k, n in r["shape_hist"].items())
        rest = r["decode_s"] * 1e3 - fitted
        new = steps * sum(n * (costs[k] - cut_all - (cut16 if k == "16" else 0.0))
                          for k, n in r["shape_hist"].items()) + rest
        logs.append(math.log(ar[(r["benchmark"], r["prompt_id"])] / new))
    return math.exp(sum(logs) / len(logs))


print(f"{len(spec)} requests, re-costed as measured: {geomean():.3f}x")
for us in (float(u) for u in args.cut_us.split(",")):
    print(f"16-row step -{us:g} us: {geomean(cut16=us / 1e3):.3f}x; every step -{us:g} us: "
          f"{geomean(cut_all=us / 1e3):.3f}x")
for pct in (float(p) for p in args.fewer.split(",")):
    print(f"{pct:g}% fewer steps: {geomean(steps=1 - pct / 100):.3f}x")
