"""Benchmark harness: AR and speculative decoding on the same prompts, interleaved, in one run.

Per request: tokens, TPOT, tokens committed per step (mean and histogram), speedup = AR decode time /
speculative decode time for the same request (prefill is the same code in both and is excluded), and
whether every token equals AR's. Geometric means per benchmark and overall, the overall one with a bootstrap
interval (requests resampled within each benchmark): with a few prompts a benchmark, a handful of requests that
loop to the token limit at 10-15 tokens a step can carry the mean (H200, session 27: the same drafter 3.15x over 4
prompts a benchmark, 2.74x over 8), and the interval shows how far a number can be leaned on.
"""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields

from tqdm import tqdm

from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.engines.config import EngineConfig
from specpilot.engines.engine import GenerationResult
from specpilot.engines.policy import STOCK, EnginePolicy
from specpilot.engines.traces import RequestTrace, StepTrace
from specpilot.stats import geomean

AR_LABEL = "ar"  # the exact AR reference (batch-invariant shapes): every variant's tokens must equal it
AR_FAST_LABEL = "ar_fast"  # the engine's fastest AR mode (per-step shapes); speedups are measured against
# the faster of the two AR modes, so a speedup never comes from a slowed-down baseline
STALL_MS = 50.0  # decode time outside a request's steps above which the report names the request
CI_LEVEL, CI_RESAMPLES = 0.9, 2000  # the overall geometric mean's bootstrap interval


@dataclass(frozen=True)
class Variant:
    """One engine configuration measured by the harness."""

    label: str
    config: EngineConfig
    drafter_label: str | None = None
    policy: EnginePolicy = STOCK  # policy code at the engine's extension points (in-process: never agent code)


@dataclass
class RequestResult:
    benchmark: str
    prompt_id: str
    variant: str
    prompt_tokens: int
    new_tokens: int
    decode_s: float
    prefill_s: float
    steps: int
    stop_reason: str
    tokens_per_step: float
    step_hist: dict[int, int]
    matches_ar: bool
    first_divergence: int | None
    speedup: float | None  # fastest AR decode time / this decode time (None for the AR modes)
    speedup_vs_exact_ar: float | None = None
    reference: str = AR_LABEL  # the AR run whose tokens this one must equal (its config's ar_twin)
    # Mean wall time per step: drafting (the drafter's propose), and the rest (verify, accept, commit; for AR the
    # step itself): where a speculative step's time goes.
    draft_ms: float | None = None
    verify_ms: float | None = None
    # Decode wall time outside the timed steps (the host between steps; device-loop chunks are timed whole): a few
    # ms at most, unless something stalled the loop (a collection, a compile, a capture).
    outside_ms: float | None = None
    # Steps by the rows their target forward verified (StepTrace.verify_tokens: 1 for AR, the tree's rows for a
    # switched 16 / 32 / 128-row line): BenchReport.step_ms_by_rows prices each shape from these.
    shape_hist: dict[int, int] = field(default_factory=dict)

    @property
    def tpot_ms(self) -> float:
        return 1e3 * self.decode_s / max(1, self.new_tokens - 1)

    @property
    def stalled(self) -> bool:
        """More than STALL_MS and a fifth of the decode outside its steps: its speedup measures the stall."""
        return self.outside_ms is not None and self.outside_ms > max(STALL_MS, 200 * self.decode_s)


@dataclass
class BenchReport:
    deployment: str
    device: str
    max_new_tokens: int
    variants: list[str]
    requests: list[RequestResult] = field(default_factory=list)
    outputs: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # variant -> prompt key -> tokens

    def geomean(self, variant: str, benchmark: str | None = None) -> float | None:
        xs = [r.speedup for r in self.requests if r.variant == variant and r.speedup
              and (benchmark is None or r.benchmark == benchmark)]
        return geomean(xs) if xs else None

    def geomean_interval(self, variant: str, level: float = CI_LEVEL, resamples: int = CI_RESAMPLES,
                         seed: int = 0) -> tuple[float, float] | None:
        """bootstrap_interval of the overall geometric mean, each benchmark's requests a stratum."""
        strata = defaultdict(list)
        for r in self.requests:
            if r.variant == variant and r.speedup:
                strata[r.benchmark].append(math.log(r.speedup))
        return bootstrap_interval(strata, level, resamples, seed)

    def all_match(self, variant: str | None = None) -> bool:
        """Every token equal to the exact AR reference (all claimed-exact variants when variant is None; the
        fastest-shapes AR mode claims no exactness and is only reported)."""
        return all(r.matches_ar for r in self.requests
                   if (variant is None and r.variant != AR_FAST_LABEL) or r.variant == variant)

    def mean(self, variant: str, attr: str) -> float | None:
        """The mean of a per-request number (tokens_per_step, tpot_ms, draft_ms, ...) over a variant's requests."""
        return _mean([x for r in self.requests if r.variant == variant and (x := getattr(r, attr)) is not None])

    def benchmarks(self) -> list[str]:
        return sorted({r.benchmark for r in self.requests})

    def by_stop(self, variant: str) -> dict[str, dict]:
        """A variant's requests grouped by how they ended (eos, max_tokens, ...): count, geometric-mean speedup and
        mean tokens per step of each group. Requests that stop early and requests that loop to the token limit sit
        at very different speedups; the overall mean hides which group holds a variant back."""
        groups = defaultdict(list)
        for r in self.requests:
            if r.variant == variant and r.speedup:
                groups[r.stop_reason].append(r)
        return {k: {"requests": len(rs), "geomean_speedup": geomean([r.speedup for r in rs]),
                    "tokens_per_step": _mean([r.tokens_per_step for r in rs])} for k, rs in sorted(groups.items())}

    def step_ms_by_rows(self, variant: str) -> dict[int, float] | None:
        """What a step of each verify shape costs in this run: least squares of the variant's decode ms over its
        requests' steps by shape (shape_hist), with one constant a request (its time outside the steps). The costs
        a replay prices switched shapes with (scripts/replay_adaptive_rows.py), read off the bench itself rather
        than off a profile. None where the requests do not determine them (fewer requests than unknowns, or shapes
        that always occur together)."""
        import numpy as np
        rs = [r for r in self.requests if r.variant == variant and r.shape_hist]
        shapes = sorted({k for r in rs for k in r.shape_hist})
        if not shapes or len(rs) < len(shapes) + 2:
            return None
        a = np.array([[r.shape_hist.get(k, 0) for k in shapes] + [1.0] for r in rs], dtype=float)
        if np.linalg.matrix_rank(a) < a.shape[1]:
            return None
        ms, *_ = np.linalg.lstsq(a, np.array([1e3 * r.decode_s for r in rs]), rcond=None)
        return {k: float(m) for k, m in zip(shapes, ms[:-1])}

    def to_dict(self) -> dict:
        summary = {v: {"geomean_speedup": self.geomean(v), "geomean_interval": self.geomean_interval(v),
                       "interval_level": CI_LEVEL, "all_match_ar": self.all_match(v),
                       "per_benchmark": {b: self.geomean(v, b) for b in self.benchmarks()},
                       "tokens_per_step": self.mean(v, "tokens_per_step"), "tpot_ms": self.mean(v, "tpot_ms"),
                       "draft_ms_per_step": self.mean(v, "draft_ms"), "verify_ms_per_step": self.mean(v, "verify_ms"),
                       "by_stop": self.by_stop(v), "step_ms_by_verify_rows": self.step_ms_by_rows(v)}
                   for v in self.variants}
        return {"deployment": self.deployment, "device": self.device, "max_new_tokens": self.max_new_tokens,
                "summary": summary, "requests": [asdict(r) | {"tpot_ms": r.tpot_ms} for r in self.requests]}


def bootstrap_interval(strata: dict[str, list[float]], level: float = CI_LEVEL, resamples: int = CI_RESAMPLES,
                       seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap percentile interval of exp(mean of logs), i.e. of a geometric mean, from log values grouped in
    strata (benchmarks; concurrencies): each resample draws every stratum's values with replacement from that
    stratum, so each keeps its weight. A stratum of one value would never vary, so where any has fewer than two, all
    values are pooled into one. Seeded (the same values give the same interval); strata are taken in name order.
    None with fewer than two values."""
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"need 0 < level < 1 and resamples >= 1, got {level}, {resamples}")
    groups = [strata[k] for k in sorted(strata) if strata[k]]
    n = sum(len(xs) for xs in groups)
    if n < 2:
        return None
    if min(len(xs) for xs in groups) < 2:
        groups = [[x for xs in groups for x in xs]]
    rng = random.Random(seed)
    means = sorted(sum(sum(rng.choices(xs, k=len(xs))) for xs in groups) / n for _ in range(resamples))
    lo = means[int((1 - level) / 2 * resamples)]
    hi = means[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return math.exp(lo), math.exp(hi)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_label(ar: EngineConfig, cfg: EngineConfig) -> str:
    """AR_LABEL when cfg's exact AR is the baseline's, else 'ar{knob=value,...}' naming the numerics it changes."""
    base, twin = ar.ar_twin(), cfg.ar_twin()
    delta = [f"{f.name}={_value(getattr(twin, f.name))}" for f in fields(twin)
             if getattr(twin, f.name) != getattr(base, f.name)]
    return AR_LABEL if not delta else f"{AR_LABEL}{{{','.join(delta)}}}"


def _value(x) -> str:
    return str(getattr(x, "value", x))


def run_bench(session: DeploymentSession, prompts: list[TokenizedPrompt], variants: list[Variant],
              max_new_tokens: int, progress: bool = True, warmup: bool = True, on_result=None,
              own_ar: bool = False) -> tuple[BenchReport, dict[str, list[StepTrace]], list[RequestTrace]]:
    """Runs every variant on every prompt, prompt by prompt (interleaved), AR first.

    Every variant's tokens are checked against the baseline AR (variants[0]): the tuning loop's bar, where no
    build may change stock's output. own_ar=True (`specpilot bench`) holds a variant whose knobs change AR's own
    numerics to the AR with those knobs instead (DESIGN's losslessness: a configuration equals its own AR)."""
    if not variants or variants[0].label != AR_LABEL:
        raise ValueError("the first variant must be the AR baseline labelled 'ar'")
    report = BenchReport(session.deployment.name, session.device, max_new_tokens, [v.label for v in variants])
    engines = {v.label: session.engine(v.config, v.drafter_label, v.policy) for v in variants}
    # A variant whose knobs change AR's own numerics is held to the AR that has them (run once per prompt).
    twins = {v.label: reference_label(variants[0].config, v.config) for v in variants
             if own_ar and v.label not in (AR_LABEL, AR_FAST_LABEL)}
    twin_engines = {label: session.engine(v.config.ar_twin()) for v in variants
                    if (label := twins.get(v.label, AR_LABEL)) != AR_LABEL}
    if warmup and prompts:  # graph capture, compilation and allocator warm-up stay out of the numbers
        for e in [*engines.values(), *twin_engines.values()]:
            e.warm_up(list(prompts[0].ids), min(8, max_new_tokens))
    steps: dict[str, list[StepTrace]] = defaultdict(list)
    req_traces: list[RequestTrace] = []
    bar = tqdm(total=len(prompts) * len(variants), desc=f"bench {session.deployment.name}", disable=not progress)
    for tp in prompts:
        ar: GenerationResult | None = None
        fastest_ar_s = float("inf")
        refs = {label: e.generate(list(tp.ids), max_new_tokens).tokens for label, e in twin_engines.items()}
        for v in variants:
            res = engines[v.label].generate(list(tp.ids), max_new_tokens, request_id=f"{tp.key}:{v.label}")
            is_ar = v.label in (AR_LABEL, AR_FAST_LABEL)
            if v.label == AR_LABEL:
                ar = res
            if is_ar:
                fastest_ar_s = min(fastest_ar_s, res.decode_s)
            hist = Counter(s.committed for s in res.steps)
            shapes = Counter(s.verify_tokens for s in res.steps)
            ref_label = twins.get(v.label, AR_LABEL)
            div = first_divergence(refs.get(ref_label, ar.tokens), res.tokens)
            rr = RequestResult(
                benchmark=tp.prompt.benchmark.value, prompt_id=tp.prompt.id, variant=v.label,
                prompt_tokens=len(tp.ids), new_tokens=len(res.tokens), decode_s=res.decode_s, prefill_s=res.prefill_s,
                steps=len(res.steps), stop_reason=res.stop_reason, tokens_per_step=res.accepted_per_step,
                step_hist=dict(sorted(hist.items())), matches_ar=div is None, first_divergence=div,
                speedup=None if is_ar else fastest_ar_s / max(res.decode_s, 1e-9),
                speedup_vs_exact_ar=None if is_ar else ar.decode_s / max(res.decode_s, 1e-9), reference=ref_label,
                draft_ms=_mean([1e3 * s.draft_s for s in res.steps]),
                verify_ms=_mean([1e3 * s.verify_s for s in res.steps]),
                outside_ms=1e3 * (res.decode_s - sum(s.draft_s + s.verify_s for s in res.steps)),
                shape_hist=dict(sorted(shapes.items())))
            report.requests.append(rr)
            report.outputs.setdefault(v.label, {})[tp.key] = res.tokens
            steps[v.label].extend(res.steps)
            req_traces.append(RequestTrace(res.steps[0].request_id if res.steps else f"{tp.key}:{v.label}",
                                           rr.benchmark, "ar" if is_ar else "spec", rr.prompt_tokens,
                                           rr.new_tokens, rr.prefill_s, rr.decode_s, rr.steps, rr.stop_reason))
            if on_result:
                on_result(rr)
            bar.update()
    bar.close()
    return report, dict(steps), req_traces


def format_report(report: BenchReport) -> str:
    lines = [f"deployment {report.deployment} on {report.device}, {report.max_new_tokens} new tokens max, "
             f"speedup = fastest AR decode time / variant decode time (geometric mean over requests); "
             f"'{AR_LABEL}' is the exact reference, '{AR_FAST_LABEL}' the fastest AR shapes; "
             f"[lo-hi]: the overall mean's {CI_LEVEL:.0%} bootstrap interval "
             "(requests resampled within each benchmark)",
             ""]
    benches = report.benchmarks()
    lines.append("| variant | " + " | ".join(benches) + " | overall | tokens/step | TPOT ms | draft ms/step | "
                 "verify ms/step | all tokens = AR |")
    lines.append("|---" * (len(benches) + 7) + "|")
    for v in report.variants:
        per = [report.geomean(v, b) for b in benches]
        tps, tpot = report.mean(v, "tokens_per_step"), report.mean(v, "tpot_ms")
        cells = ["-" if x is None else f"{x:.2f}x" for x in per]
        overall, interval = report.geomean(v), report.geomean_interval(v)
        overall_cell = "-" if overall is None else f"{overall:.2f}x" + (
            f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else "")
        split = [report.mean(v, "draft_ms"), report.mean(v, "verify_ms")]
        numbers = ["-" if x is None else f"{x:.2f}" for x in (tps, tpot)]
        numbers += ["-" if x is None else f"{x:.3f}" for x in split]
        lines.append(f"| {v} | " + " | ".join([*cells, overall_cell, *numbers])
                     + f" | {'yes' if report.all_match(v) else 'NO'} |")
    for v in report.variants:
        groups = report.by_stop(v)
        if len(groups) > 1:  # one group is the overall row again
            lines.append(f"{v} by stop: " + "; ".join(
                f"{k} {g['requests']} requests {g['geomean_speedup']:.2f}x, {g['tokens_per_step']:.2f} tokens/step"
                for k, g in groups.items()))
    for v in report.variants:
        by_rows = report.step_ms_by_rows(v)
        if by_rows and len(by_rows) > 1:  # one shape: its cost is the table's ms/step
            lines.append(f"{v} ms a step by verify rows (least squares over its requests): "
                         + ", ".join(f"{k}: {m:.3f}" for k, m in by_rows.items()))
    for ref in sorted({r.reference for r in report.requests} - {AR_LABEL}):
        users = sorted({r.variant for r in report.requests if r.reference == ref})
        lines.append(f"{', '.join(users)}: checked against {ref}, the AR with the numerics these variants change")
    for r in (r for r in report.requests if not r.matches_ar):
        what = ("differs from exact AR (fastest shapes: exactness not claimed)" if r.variant == AR_FAST_LABEL
                else "MISMATCH")
        lines.append(f"{r.variant} {r.benchmark}/{r.prompt_id}: {what} (vs {r.reference}), first divergence at token "
                     f"{r.first_divergence}")
    for r in (r for r in report.requests if r.stalled):
        lines.append(f"{r.variant} {r.benchmark}/{r.prompt_id}: STALL, {r.outside_ms:.0f} ms of its "
                     f"{1e3 * r.decode_s:.0f} ms decode ran outside its steps (a collection, a compile or a capture?): "
                     "its speedup measures it")
    return "\n".join(lines)
