"""Explore's quick benchmark for the batch regime: candidates served by the batched engine on the tune prompts.

The same contract as QuickBench (one Measurement per candidate in one log, the build measured in every bench run
as the baseline), measured the batch regime's way: each candidate's throughput at every concurrency of the
deployment, under its arrival process, next to batched AR and the stock batched build (every batching mechanism
off) in the same run. objective = geometric mean over concurrencies of throughput / batched AR throughput (0 when
any request's tokens differ from batched AR's); speedups over stock are kept in the rows. With repeats, each
build keeps its fastest run per concurrency (robust to interference on a shared machine).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from specpilot.bench.batched import AR_LABEL, STOCK_LABEL
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.stages.batch_bench import BatchBench, LevelRun, Throughputs
from specpilot.stages.candidate import Candidate
from specpilot.stages.catalog import stock_candidate
from specpilot.stages.quickbench import Measurement, QuickBench, TrialStatus
from specpilot.stats import geomean_of_runs


def fastest(runs: list[Throughputs]) -> Throughputs:
    """Per build and concurrency, the fastest of repeated measurements; a mismatch in any repeat is kept."""
    out = Throughputs(errors={k: v for t in runs for k, v in t.errors.items()})
    for t in runs:
        for label, levels in t.levels.items():
            mine = out.levels.setdefault(label, {})
            for c, run in levels.items():
                best = mine.get(c)
                keep = run if best is None or run.throughput > best.throughput else best
                mine[c] = dataclasses.replace(keep, matches_ar=run.matches_ar and (best is None or best.matches_ar))
    return out


class BatchQuickBench(QuickBench):
    """QuickBench's interface (enqueue, flush, record, latest_baseline, measured, log, baselines, rows) over the
    batched engine. Labels inside a run are positional (stock, baseline, cand<i>): candidate names are free text."""

    BASELINE = "baseline"

    def __init__(self, session: DeploymentSession, prompts: list[TokenizedPrompt], max_new_tokens: int,
                 baseline: Candidate, repeats: int = 1):
        super().__init__(session, prompts, max_new_tokens, baseline, repeats)
        self.bench = BatchBench(session)
        self.stock = stock_candidate(session.deployment)

    def __call__(self, candidates: list[Candidate]) -> list[Measurement]:
        todo, self._queue = self._queue + list(candidates), []
        index = len(self.baselines)
        builds = {STOCK_LABEL: self.stock}
        if self.baseline.build_digest != self.stock.build_digest:  # round 1: the build is stock, measured once
            builds[self.BASELINE] = self.baseline
        builds.update({f"cand{i}": c for i, c in enumerate(todo)})
        result = fastest([self.bench.measure(self.prompts, self.max_new_tokens, builds) for _ in range(self.repeats)])
        base_label = self.BASELINE if self.BASELINE in builds else STOCK_LABEL
        if base_label in result.errors:
            raise RuntimeError(f"the build does not run on the batched engine: {result.errors[base_label]}")

        def measure(c: Candidate, label: str, base: float) -> Measurement:
            if label in result.errors:
                return Measurement(c, 0.0, base, 0.0, False, index, result.errors[label], TrialStatus.NOT_RUN)
            ok = result.matches(label)
            levels = result.levels[label].values()
            return Measurement(c, geomean_of_runs(result.speedup(label).values()) if ok else 0.0, base,
                               sum(r.tokens_per_step for r in levels) / len(levels), ok, index,
                               "" if ok else "output differs from batched AR on the tune prompts",
                               TrialStatus.OK if ok else TrialStatus.LOSSY)

        base = measure(self.baseline, base_label, 0.0)
        self.baselines.append(dataclasses.replace(base, baseline=base.objective))
        out = [measure(c, f"cand{i}", base.objective) for i, c in enumerate(todo)]
        names = {STOCK_LABEL: STOCK_LABEL, self.BASELINE: self.BASELINE, AR_LABEL: AR_LABEL,
                 **{f"cand{i}": c.name for i, c in enumerate(todo)}}
        self.rows += [_row(index, names[label], run, result, label) for label, levels in result.levels.items()
                      for run in levels.values()]
        self.log += out
        return out[len(todo) - len(candidates):]


def _row(index: int, variant: str, run: LevelRun, result: Throughputs, label: str) -> dict[str, Any]:
    """One parquet row per (build, concurrency): the batch regime's measurements.parquet."""
    vs_ar, vs_stock = result.speedup(label), result.speedup(label, STOCK_LABEL) if STOCK_LABEL in result.levels else {}
    return {"batch": index, "variant": variant, "concurrency": run.concurrency, "throughput": run.throughput,
            "tokens_per_step": run.tokens_per_step, "tpot_p50_ms": run.tpot_p50_ms, "tpot_p99_ms": run.tpot_p99_ms,
            "rate": run.rate, "matches_ar": run.matches_ar, "speedup_vs_ar": vs_ar[run.concurrency],
            "speedup_vs_stock": vs_stock.get(run.concurrency)}
