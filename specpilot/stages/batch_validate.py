"""Losslessness under batching: every request a candidate serves batched equals its single-request AR output.

The reference is the stock build's autoregressive output from the single-request engine (SpecEngine on the same
Triton kernels, which are batch-invariant: a row's bits do not depend on how many requests share a forward), one
held-out prompt at a time. The candidate then serves those prompts with the batched engine at every concurrency
of the deployment under its arrival process, next to stock batched and batched AR, and every request's tokens
must equal its prompt's reference. At a request's first differing token the reference's forced pass (its top-2
and logit margin at every position, given the reference prefix) tells a numerical TIE (the candidate took the
reference's runner-up within tie_epsilon) from a FAIL. Stock batched or batched AR differing from the reference
is a REFERENCE divergence: the batched engine itself is not lossless there, so nothing passes on it. The
speedup is throughput over stock batched, per concurrency; a suspiciously large one is measured again and the
candidate's outputs are checked again (RERUN).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from specpilot.bench.batched import AR_LABEL, STOCK_LABEL
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.engines.config import DrafterKind, VerifyMode
from specpilot.stages.batch_bench import BatchBench, Throughputs
from specpilot.stages.candidate import Candidate
from specpilot.stages.validate import (Divergence, DivergenceKind, ForcedPass, SpeedupCheck, VerdictKind, _classify,
                                       _reasons, forced_pass, forced_runner)

CANDIDATE = "candidate"


@dataclass(frozen=True)
class BatchVerdict:
    kind: VerdictKind
    stock: str
    candidate: str
    tie_epsilon: float
    max_new_tokens: int
    concurrency: tuple[int, ...]
    arrival: str
    prompts: int  # held-out prompts; each concurrency serves max(concurrency, prompts) requests of them
    divergences: tuple[Divergence, ...]  # the first per request and build
    speedup: SpeedupCheck  # per concurrency: candidate throughput / stock throughput
    reasons: tuple[str, ...]
    batch_config: dict[str, Any]  # the candidate's BatchConfig, as validated

    @property
    def ties(self) -> tuple[Divergence, ...]:
        return tuple(d for d in self.divergences if d.tie)

    def per_benchmark(self) -> dict[str, float]:
        """Speedup over stock per measured setting, keyed as memory's evidence rows name them: c<n>-<arrival>."""
        return {f"c{c}-{self.arrival}": s for c, s in zip(self.concurrency, self.speedup.first)}

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        first = next((d for d in self.divergences if not d.tie), self.divergences[0] if self.divergences else None)
        return {**out, "regime": "batch", "kind": self.kind.value, "concurrency": list(self.concurrency),
                "divergences": [d.to_dict() for d in self.divergences], "reasons": list(self.reasons),
                "first_divergence": first.to_dict() if first else None, "per_benchmark": self.per_benchmark(),
                "speedup": {"threshold": self.speedup.threshold, "first": list(self.speedup.first),
                            "remeasured": None if self.speedup.remeasured is None else list(self.speedup.remeasured),
                            "geomean": self.speedup.geomean if self.speedup.first else None,
                            "remeasured_geomean": self.speedup.remeasured_geomean}}


def write_batch_verdict(verdict: BatchVerdict, out_dir: str | Path) -> Path:
    """verdict.json and ties.jsonl (the tie log), as the single-request verdict writes them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdict.json").write_text(json.dumps(verdict.to_dict(), indent=2))
    (out / "ties.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in verdict.ties))
    return out / "verdict.json"


def validate_batched(session: DeploymentSession, stock: Candidate, candidate: Candidate,
                     prompts: Sequence[TokenizedPrompt], max_new_tokens: int, tie_epsilon: float, *,
                     speedup_threshold: float = 20.0) -> BatchVerdict:
    if not prompts:
        raise ValueError("validate needs at least one held-out prompt")
    if tie_epsilon < 0 or max_new_tokens < 1:
        raise ValueError(f"tie_epsilon={tie_epsilon} must be >= 0 and max_new_tokens={max_new_tokens} >= 1")
    regime = session.deployment.regime
    ar = session.engine(stock.config.replace(drafter=DrafterKind.NONE, verify=VerifyMode.CHAIN))
    reference = {p.key: ar.generate(list(p.ids), max_new_tokens, p.key).tokens for p in prompts}
    bench = BatchBench(session)
    builds = {STOCK_LABEL: stock, CANDIDATE: candidate}
    first = bench.measure(prompts, max_new_tokens, builds)
    batch = candidate.batch_config.to_dict() if candidate.batch_config is not None else {}

    def verdict(divergences: list[Divergence], check: SpeedupCheck, extra: tuple[str, ...] = ()) -> BatchVerdict:
        return BatchVerdict(_classify(divergences) if not extra else VerdictKind.FAIL, stock.name, candidate.name,
                            tie_epsilon, max_new_tokens, regime.concurrency, regime.arrival.value,
                            len(prompts), tuple(divergences), check,
                            extra + _reasons(divergences, check, tie_epsilon), batch)

    for label in (STOCK_LABEL, CANDIDATE):
        if label in first.errors:  # stock must run for a verdict at all; a candidate that cannot is no pass
            why = f"{label} did not run on the batched engine: {first.errors[label]}"
            if label == STOCK_LABEL:
                raise RuntimeError(why)
            return verdict([], SpeedupCheck(speedup_threshold, ()), (why,))
    check = SpeedupCheck(speedup_threshold, tuple(first.speedup(CANDIDATE, STOCK_LABEL).values()))
    rerun = None
    if check.geomean > speedup_threshold:  # too good to be true (a cache, a skipped check?): measure again
        rerun = bench.measure(prompts, max_new_tokens, builds)
        check = SpeedupCheck(speedup_threshold, check.first, tuple(rerun.speedup(CANDIDATE, STOCK_LABEL).values()))
    margins: dict[str, ForcedPass] = {}
    runner = None

    def forced(key: str) -> ForcedPass:
        nonlocal runner
        if key not in margins:  # computed only where something differs: a forced pass costs a decode
            runner = runner or forced_runner(ar)
            ids = next(p.ids for p in prompts if p.key == key)
            margins[key] = forced_pass(runner, ids, reference[key], max_new_tokens)
        return margins[key]

    divergences = []
    for kind, result, labels in ((DivergenceKind.REFERENCE, first, (AR_LABEL, STOCK_LABEL)),
                                 (DivergenceKind.FREE_RUNNING, first, (CANDIDATE,)),
                                 (DivergenceKind.RERUN, rerun, (CANDIDATE,))):
        if result is not None:
            divergences += _diverged(kind, result, labels, reference, forced, tie_epsilon)
    return verdict(divergences, check)


def _diverged(kind: DivergenceKind, result: Throughputs, labels: tuple[str, ...], reference: dict[str, list[int]],
              forced, eps: float) -> list[Divergence]:
    """The first differing token of every request (of `labels`, at every concurrency) against its reference."""
    out = []
    for label in labels:
        for conc, run in result.levels[label].items():
            for rid, tokens in run.outputs.items():
                key = rid.rsplit("#", 1)[0]  # request ids are "<prompt key>#<repeat>"
                want = reference[key]
                i = next((j for j, (a, b) in enumerate(zip(want, tokens)) if a != b), min(len(want), len(tokens)))
                if i == len(want) == len(tokens):
                    continue
                got = tokens[i] if i < len(tokens) else None
                ref = forced(key) if i < len(want) and got is not None else None
                # A tie: the reference itself saw a near-tie here, and the build took its runner-up.
                tie = ref is not None and ref.margin[i] <= eps and ref.runner_up[i] == got
                out.append(Divergence(kind, f"{label}:{rid}@c{conc}", i, want[i] if i < len(want) else None, got,
                                      ref.margin[i] if ref else None, None, ref.runner_up[i] if ref else None, None,
                                      tie))
    return out
