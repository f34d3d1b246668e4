"""Integrate's held-out comparison of the builds (stock, the current build, the integrated candidate), per regime.

Single regime: each build decodes the held-out prompts one request at a time next to AR (bench.harness); a
build's speed is its geometric-mean per-request speedup over AR. Batch regime: each build serves the held-out
prompts with the batched engine at every concurrency of the deployment under its arrival process, next to
batched AR (stages/batch_bench.py); its speed is the geometric mean over concurrencies of its throughput over
batched AR. Either way the result says, per build, its speedup over AR, overall and per benchmark (batch regime:
per concurrency, `c<n>-<arrival>`, as memory's evidence rows name them), whether every token equalled AR's, and
how much faster the final build is than stock, and per pair of builds a paired bootstrap interval of one's speed over
the other's (request by request, or concurrency by concurrency), which integrate reads before it adopts a candidate.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from specpilot.bench.harness import AR_LABEL, CI_LEVEL, Variant, bootstrap_interval, run_bench
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.stages.batch_bench import BatchBench
from specpilot.stages.candidate import Candidate
from specpilot.stats import geomean, geomean_of_runs


@dataclass(frozen=True)
class Heldout:
    speedup_vs_ar: dict[str, float]  # build label -> geomean speedup over AR (0: did not run)
    per_benchmark: dict[str, dict[str, float | None]]  # build label -> benchmark (or c<n>-<arrival>) -> speedup
    matches_ar: dict[str, bool]  # build label -> every token equal to AR's
    final_vs_stock: dict[str, float]  # build label -> geomean of its speed over stock's, request by request
    # (batch regime: concurrency by concurrency); empty when stock is not among the builds
    prompts: int
    max_new_tokens: int
    report: dict[str, Any] = field(default_factory=dict, compare=False)  # heldout.json
    # build label -> (stratum, unit) -> its speed there (single: 1 / decode s of a request, stratum its benchmark;
    # batch: throughput over batched AR at a concurrency, one stratum): what ratio_interval pairs
    unit_speeds: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict, compare=False)

    def benchmarks(self) -> list[str]:
        return sorted({b for per in self.per_benchmark.values() for b in per})

    def ratio_interval(self, a: str, b: str, level: float = CI_LEVEL) -> tuple[float, float] | None:
        """A paired bootstrap interval of build a's speed over build b's (the geometric mean of their per-unit ratios,
        units resampled within strata); None with fewer than two shared units."""
        sa, sb = self.unit_speeds.get(a, {}), self.unit_speeds.get(b, {})
        strata = defaultdict(list)
        for key in sorted(sa.keys() & sb.keys()):
            if sa[key] > 0 and sb[key] > 0:
                strata[key[0]].append(math.log(sa[key] / sb[key]))
        return bootstrap_interval(strata, level)

    def geomean(self, label: str, benchmark: str | None = None) -> float | None:
        """BenchReport's accessor: overall or one benchmark's speedup over AR (None when not measured)."""
        if label not in self.speedup_vs_ar:
            return None
        return self.speedup_vs_ar[label] if benchmark is None else self.per_benchmark[label].get(benchmark)


def heldout_single(session: DeploymentSession, builds: dict[str, Candidate], prompts: list[TokenizedPrompt],
                   max_new_tokens: int) -> Heldout:
    dep = session.deployment
    variants = [Variant(AR_LABEL, dep.ar_config())] + [Variant(label, c.config, c.drafter_label)
                                                       for label, c in builds.items()]
    report, _, _ = run_bench(session, prompts, variants, max_new_tokens, warmup=True)
    decode = {(r.variant, r.prompt_id, r.benchmark): r.decode_s for r in report.requests}

    def vs_stock(label: str) -> float:
        ratios = [decode[("stock", p, b)] / max(decode[(label, p, b)], 1e-9) for (v, p, b) in decode if v == "stock"]
        return geomean(ratios)

    return Heldout({label: report.geomean(label) or 0.0 for label in builds},
                   {label: {b: report.geomean(label, b) for b in report.benchmarks()} for label in builds},
                   {label: report.all_match(label) for label in builds},
                   {label: vs_stock(label) for label in builds} if "stock" in builds else {},
                   len({r.prompt_id for r in report.requests}), max_new_tokens, report.to_dict(),
                   {label: {(b, p): 1.0 / max(t, 1e-9) for (v, p, b), t in decode.items() if v == label}
                    for label in builds})


def heldout_batched(session: DeploymentSession, builds: dict[str, Candidate], prompts: list[TokenizedPrompt],
                    max_new_tokens: int) -> Heldout:
    arrival = session.deployment.regime.arrival.value
    result = BatchBench(session).measure(prompts, max_new_tokens, builds)
    if "stock" in result.errors:
        raise RuntimeError(f"stock does not run on the batched engine: {result.errors['stock']}")
    ran = [label for label in builds if label not in result.errors]
    speedups = {label: result.speedup(label) for label in ran}
    report = {"regime": session.deployment.regime.label, "max_new_tokens": max_new_tokens, "prompts": len(prompts),
              "errors": result.errors, "levels": {label: {str(c): {k: v for k, v in vars(run).items() if k != "outputs"}
                                                          for c, run in levels.items()}
                                                  for label, levels in result.levels.items()}}
    return Heldout({label: geomean_of_runs(speedups[label].values()) if label in ran else 0.0 for label in builds},
                   {label: {f"c{c}-{arrival}": s for c, s in speedups.get(label, {}).items()} for label in builds},
                   {label: result.matches(label) for label in builds},
                   {label: geomean_of_runs(result.speedup(label, "stock").values()) if label in ran else 0.0
                    for label in builds} if "stock" in builds else {}, len(prompts), max_new_tokens, report,
                   {label: {("levels", f"c{c}"): x for c, x in speedups[label].items()} for label in ran})

