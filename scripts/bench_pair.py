"""Two variants of one bench, request by request (CPU, no model): the per-request speedup ratio B / A.

python3 scripts/bench_pair.py BENCH.json [--a SUBSTRING] [--b SUBSTRING]

BENCH.json (or .json.gz): `specpilot bench`'s bench.json with one AR variant and at least two speculative ones
(e.g. gpu_drafter_ab.sh's shipped line and its ALSO variants). --a / --b pick variants by a substring of their label
(default: the first two speculative variants in file order; with one of them given, the other is the first
remaining). Prints each variant's overall geometric mean with its bootstrap interval, then B over A per request:
the geometric mean of the ratios with a bootstrap interval (benchmarks as strata), how many requests got faster and
how many took the same steps, and the ratio apart for requests that stopped at EOS and those that ran to max_tokens
(the loops), and whether every token of both equals AR.
"""
import argparse
import gzip
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specpilot.bench.harness import bootstrap_interval  # noqa: E402


def load(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)["requests"]


def pick(variants: list[str], sub: str | None, taken: str | None) -> str:
    pool = [v for v in variants if v != taken]
    if sub is None:
        return pool[0]
    hits = [v for v in pool if sub in v]
    if len(hits) != 1:
        raise SystemExit(f"{sub!r} matches {len(hits)} variants of {variants}")
    return hits[0]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def interval(by_bench: dict[str, list[float]]) -> str:
    ci = bootstrap_interval({b: [math.log(x) for x in xs] for b, xs in by_bench.items()})
    return f"[{ci[0]:.3f}-{ci[1]:.3f}]" if ci else "[-]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("--a", help="substring of variant A's label (default: the first speculative variant)")
    ap.add_argument("--b", help="substring of variant B's label (default: the next one)")
    args = ap.parse_args()
    reqs = load(args.bench)
    variants = list(dict.fromkeys(r["variant"] for r in reqs if r["variant"] != "ar"))
    if len(variants) < 2:
        raise SystemExit(f"{args.bench}: want two speculative variants, found {variants}")
    if args.a is None and args.b is not None:  # B given: A is the first other variant
        b = pick(variants, args.b, None)
        a = pick(variants, None, b)
    else:
        a = pick(variants, args.a, None)
        b = pick(variants, args.b, a)
    by = {v: {(r["benchmark"], r["prompt_id"]): r for r in reqs if r["variant"] == v} for v in (a, b)}
    keys = sorted(set(by[a]) & set(by[b]))
    if not keys:
        raise SystemExit("the two variants share no request")
    for name, v in (("A", a), ("B", b)):
        per = {}
        for k in keys:
            per.setdefault(k[0], []).append(by[v][k]["speedup"])
        every = [x for xs in per.values() for x in xs]
        match = all(by[v][k]["matches_ar"] for k in keys)
        print(f"{name}: {geomean(every):.3f}x {interval(per)} over {len(every)} requests, every token = AR: {match}"
              f"\n   {v}")
    ratios, groups = {}, {"eos": [], "max_tokens": []}
    for k in keys:
        ra, rb = by[a][k], by[b][k]
        x = ra["decode_s"] / rb["decode_s"]
        ratios.setdefault(k[0], []).append(x)
        groups["eos" if ra["stop_reason"] == "eos" else "max_tokens"].append(x)
    every = [x for xs in ratios.values() for x in xs]
    same = sum(by[a][k]["steps"] == by[b][k]["steps"] for k in keys)
    print(f"B / A per request: {geomean(every):.4f}x {interval(ratios)}, {sum(x > 1 for x in every)} of {len(keys)}"
          f" faster, {same} the same steps")
    for g, xs in groups.items():
        if xs:
            print(f"   stopped at {g} ({len(xs)}): {geomean(xs):.4f}x")


if __name__ == "__main__":
    main()
