"""Explore's quick benchmark: candidates decoded on the tune prompts next to AR and the current build.

Every candidate any proposer tries becomes a Measurement in one log, whoever measured it: QuickBench decodes
in-process candidates (config deltas, our own policy code) interleaved with a fresh AR reference and the build;
agent-written code is measured in the sandbox (specpilot.agents.trials) and its outcome recorded here, against
the build's latest baseline, so selection, validation and integration treat it like any other candidate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from specpilot.bench.harness import AR_LABEL, BenchReport, RequestResult, Variant, run_bench
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.engines.config import ConfigError
from specpilot.stages.candidate import Candidate
from specpilot.stats import geomean_of_runs


class TrialStatus(str, Enum):
    OK = "ok"  # decoded; every token equal to AR's on the tune prompts
    LOSSY = "lossy"  # decoded; the output differs from AR's
    NOT_RUN = "not_run"  # not buildable or not runnable (a config error, code that raised)
    STOPPED = "stopped"  # agent code stopped by the sandbox (a guard, or a time or memory limit)


@dataclass(frozen=True)
class Measurement:
    candidate: Candidate
    objective: float  # geomean speedup vs AR on the quick bench; 0 if lossy vs AR or not run
    baseline: float  # the current build's geomean speedup vs AR in the same bench run (sandbox: the latest one)
    tokens_per_step: float
    matches_ar: bool
    batch: int
    error: str = ""
    status: TrialStatus = TrialStatus.OK

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TrialStatus(self.status))

    @property
    def beats_baseline(self) -> bool:
        return self.status is TrialStatus.OK and self.objective > self.baseline

    @property
    def ran(self) -> bool:
        """Decoded to the end, lossless or not: token forcing can give it a verdict."""
        return self.status in (TrialStatus.OK, TrialStatus.LOSSY)

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        """What makes two candidates the same build: config (and batching config), drafter and policy code."""
        return self.candidate.build_digest, self.candidate.drafter_label, self.candidate.policy

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.to_dict(), "objective": self.objective, "baseline": self.baseline,
                "tokens_per_step": self.tokens_per_step, "matches_ar": self.matches_ar, "batch": self.batch,
                "error": self.error, "status": self.status.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurement":
        return cls(**{**d, "candidate": Candidate.from_dict(d["candidate"])})


def _fastest(reports: list[BenchReport]) -> dict[tuple[str, str], RequestResult]:
    """(variant, prompt) -> the request's fastest decode over repeated bench runs."""
    best: dict[tuple[str, str], RequestResult] = {}
    for report in reports:
        for r in report.requests:
            key = (r.variant, f"{r.benchmark}/{r.prompt_id}")
            if key not in best or r.decode_s < best[key].decode_s:
                best[key] = r
    return best


class QuickBench:
    """Decodes candidates on the tune prompts next to a fresh AR reference and the current build (the baseline),
    interleaved per prompt, so each candidate is compared with the baseline measured under the same conditions.
    Candidates queued with `enqueue` (memory's) are decoded first, with the next batch."""

    BASELINE = "baseline"

    def __init__(self, session: DeploymentSession, prompts: list[TokenizedPrompt], max_new_tokens: int,
                 baseline: Candidate, repeats: int = 1):
        self.session, self.prompts, self.max_new_tokens, self.baseline = session, prompts, max_new_tokens, baseline
        self.repeats = repeats  # bench runs per batch; each request keeps its fastest run (robust to interference)
        self.log: list[Measurement] = []  # every candidate measured, in order
        self.baselines: list[Measurement] = []  # the build, once per bench run
        self.rows: list[dict[str, Any]] = []
        self._queue: list[Candidate] = []
        self._warmed: set[int] = set()  # engines are cached by the session: warm each once

    def enqueue(self, candidates: list[Candidate]) -> None:
        self._queue += candidates

    def flush(self) -> list[Measurement]:
        return self([]) if self._queue else []

    def record(self, measurement: Measurement) -> None:
        """A measurement made elsewhere (agent code in the sandbox) joins the log."""
        self.log.append(measurement)

    def latest_baseline(self) -> Measurement:
        """The build's most recent measurement; measured now (with anything queued) if there is none yet."""
        if not self.baselines:
            self([])
        return self.baselines[-1]

    def __call__(self, candidates: list[Candidate]) -> list[Measurement]:
        todo, self._queue = self._queue + list(candidates), []
        batch, dep = len(self.baselines), self.session.deployment
        built, failed, policies = [], {}, {}
        self._warm(self.session.engine(dep.ar_config()))
        self._warm(self.session.engine(self.baseline.config, self.baseline.drafter_label))
        for c in todo:
            try:
                # Policy code runs in-process only when it is ours; agent code is refused here (PermissionError)
                # and measured in the sandbox instead.
                policies[c.name] = c.load_policy()
                self._warm(self.session.engine(c.config, c.drafter_label, policies[c.name]))
                built.append(c)
            except (ConfigError, ValueError, RuntimeError, PermissionError) as e:  # not buildable or runnable here
                failed[c.name] = f"{type(e).__name__}: {e}"
        variants = [Variant(AR_LABEL, dep.ar_config()), Variant(self.BASELINE, self.baseline.config,
                                                               self.baseline.drafter_label)]
        variants += [Variant(c.name, c.config, c.drafter_label, policies[c.name]) for c in built]
        reports = [run_bench(self.session, self.prompts, variants, self.max_new_tokens, progress=False, warmup=False)[0]
                   for _ in range(self.repeats)]
        fastest = _fastest(reports)

        def measure(c: Candidate, label: str, base: float) -> Measurement:
            if c.name in failed:
                return Measurement(c, 0.0, base, 0.0, False, batch, failed[c.name], TrialStatus.NOT_RUN)
            ok = all(r.all_match(label) for r in reports)
            speedups = [fastest[(AR_LABEL, key)].decode_s / max(req.decode_s, 1e-9)
                        for (variant, key), req in fastest.items() if variant == label]
            steps = [req.tokens_per_step for (variant, _), req in fastest.items() if variant == label]
            return Measurement(c, geomean_of_runs(speedups) if ok else 0.0, base, sum(steps) / len(steps), ok, batch,
                               "" if ok else "output differs from AR on the tune prompts",
                               TrialStatus.OK if ok else TrialStatus.LOSSY)

        base = measure(self.baseline, self.BASELINE, 0.0)
        self.baselines.append(dataclasses.replace(base, baseline=base.objective))
        out = [measure(c, c.name, base.objective) for c in todo]
        self.rows += [{"batch": batch, "repeat": i, "variant": r.variant, "benchmark": r.benchmark,
                       "prompt_id": r.prompt_id, "new_tokens": r.new_tokens, "decode_s": r.decode_s, "steps": r.steps,
                       "tokens_per_step": r.tokens_per_step, "matches_ar": r.matches_ar, "speedup": r.speedup}
                      for i, report in enumerate(reports) for r in report.requests]
        self.log += out
        return out[len(todo) - len(candidates):]

    def _warm(self, engine) -> None:
        """Once per engine: one-time costs (allocation, kernel compilation, graph capture) stay out of timings."""
        if id(engine) not in self._warmed:
            engine.warm_up(list(self.prompts[0].ids), 2)
            self._warmed.add(id(engine))

    def measured(self, build_digest: str, label: str | None) -> Measurement | None:
        """The build's or a logged candidate's measurement of this build without policy code (the search's
        configs), if any: the search tells it to its optimizer instead of decoding it again."""
        return measured_in([*self.baselines[:1], *self.log], build_digest, label)


def measured_in(log: list[Measurement], build_digest: str, label: str | None) -> Measurement | None:
    """The first measurement in `log` of this build (Candidate.build_digest) without policy code."""
    return next((m for m in log if m.candidate.policy is None and m.candidate.build_digest == build_digest
                 and m.candidate.drafter_label == label), None)
