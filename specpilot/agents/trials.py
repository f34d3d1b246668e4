"""Quick trials of one candidate against the AR baseline: what the agent's `try_candidate` tool runs.

A trial decodes the tune prompts with the candidate and with AR and reports the geometric-mean speedup and
whether every token matched AR. Config-only candidates run in-process (through explore's QuickBench when
the explore stage provides one, so the measurement joins its log); candidates with agent code run in the
sandbox, with AR decoded here, and in explore LoggedSandboxTrial adds their outcome to the same log. The agent
sees speedups and match flags, never the reference tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from specpilot.agents.protocol import PromptIds, SandboxOutcome, SandboxStatus
from specpilot.agents.sandbox import SandboxedPolicyRunner
from specpilot.bench.session import TokenizedPrompt
from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.stages.candidate import Candidate
from specpilot.stages.quickbench import Measurement, QuickBench, TrialStatus
from specpilot.stages.validate import EngineFactory
from specpilot.stats import geomean

FLOOR_S = 1e-6
# A guard or a limit ended the run: the code did something it may not (or too much of it), not merely a bug.
STOPPING = frozenset({SandboxStatus.VIOLATION, SandboxStatus.TIMEOUT, SandboxStatus.CPU_LIMIT,
                      SandboxStatus.MEMORY_LIMIT})


@dataclass(frozen=True)
class TrialOutcome:
    candidate: str
    speedup: float  # geometric mean of AR decode time / candidate decode time; 0 when it did not run or was lossy
    tokens_match: bool  # every output token equal to AR's on the trial prompts
    tokens_per_step: float
    error: str = ""  # why it did not run, or why its output does not count
    sandbox: SandboxOutcome | None = None  # for candidates with agent code
    baseline: float | None = None  # the current build's speedup vs AR in the same bench run, when measured

    @property
    def stopped_by_sandbox(self) -> bool:
        return self.sandbox is not None and not self.sandbox.ok

    def for_agent(self) -> dict[str, Any]:
        """What the agent's tool result says (no reference tokens)."""
        out: dict[str, Any] = {"candidate": self.candidate, "speedup_vs_ar": round(self.speedup, 4),
                               "tokens_match_ar": self.tokens_match, "tokens_per_step": round(self.tokens_per_step, 3)}
        if self.baseline is not None:
            out["current_build_speedup_vs_ar"] = round(self.baseline, 4)
        if self.error:
            out["error"] = self.error
        if self.sandbox is not None:
            out["sandbox"] = {"status": self.sandbox.status.value, "layers": list(self.sandbox.layers),
                              "blocked": [f"{v.event}: {v.detail}" for v in self.sandbox.violations]}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**self.for_agent(), "sandbox": self.sandbox.to_dict() if self.sandbox else None}


class CandidateTrial(Protocol):
    def __call__(self, candidate: Candidate) -> TrialOutcome: ...


class QuickBenchTrial:
    """Config-only candidates through explore's QuickBench: its AR reference, its log."""

    def __init__(self, bench: "QuickBench"):
        self.bench = bench

    def __call__(self, candidate: Candidate) -> TrialOutcome:
        m = self.bench([candidate])[0]
        return TrialOutcome(candidate.name, m.objective, m.matches_ar, m.tokens_per_step, m.error, baseline=m.baseline)


class EngineTrial:
    """Config-only candidates decoded in-process next to AR, over any engine factory."""

    def __init__(self, factory: EngineFactory, ar_config: EngineConfig, prompts: Sequence[TokenizedPrompt],
                 max_new_tokens: int):
        self.factory, self.ar_config, self.prompts, self.max_new_tokens = factory, ar_config, list(prompts), max_new_tokens

    def __call__(self, candidate: Candidate) -> TrialOutcome:
        if candidate.policy is not None:
            return TrialOutcome(candidate.name, 0.0, False, 0.0, "policy code runs only in the sandbox")
        try:
            engine = self.factory.engine(candidate.config, candidate.drafter_label)
        except (ConfigError, ValueError) as e:
            return TrialOutcome(candidate.name, 0.0, False, 0.0, f"{type(e).__name__}: {e}")
        ar = self.factory.engine(self.ar_config)
        first = list(self.prompts[0].ids)
        ar.generate(first, 2), engine.generate(first, 2)  # warm-up
        speedups, match, per_step = [], True, []
        for p in self.prompts:
            a = ar.generate(list(p.ids), self.max_new_tokens, p.key)
            c = engine.generate(list(p.ids), self.max_new_tokens, p.key)
            match &= a.tokens == c.tokens
            speedups.append(max(a.decode_s, FLOOR_S) / max(c.decode_s, FLOOR_S))
            per_step.append(c.accepted_per_step)
        return TrialOutcome(candidate.name, geomean(speedups) if match else 0.0, match, sum(per_step) / len(per_step),
                            "" if match else "output differs from AR on the trial prompts")


class SandboxTrial:
    """Candidates with agent code: AR decoded here, the candidate in a sandboxed child process."""

    def __init__(self, runner: SandboxedPolicyRunner, factory: EngineFactory, ar_config: EngineConfig,
                 prompts: Sequence[TokenizedPrompt], max_new_tokens: int):
        self.runner, self.factory, self.ar_config = runner, factory, ar_config
        self.prompts, self.max_new_tokens = list(prompts), max_new_tokens

    def __call__(self, candidate: Candidate) -> TrialOutcome:
        if candidate.policy is None:
            return TrialOutcome(candidate.name, 0.0, False, 0.0, "no policy code to run in the sandbox")
        ar = self.factory.engine(self.ar_config)
        ar.generate(list(self.prompts[0].ids), 2)
        refs = {p.key: ar.generate(list(p.ids), self.max_new_tokens, p.key) for p in self.prompts}
        outcome = self.runner.generate(candidate, [PromptIds(p.key, tuple(p.ids)) for p in self.prompts],
                                       self.max_new_tokens)
        if not outcome.ok:
            return TrialOutcome(candidate.name, 0.0, False, 0.0, outcome.reason(), outcome)
        runs = {r.key: r for r in outcome.runs}
        if set(runs) != set(refs):
            return TrialOutcome(candidate.name, 0.0, False, 0.0, "sandbox result lacks prompts", outcome)
        match = all(list(runs[k].tokens) == refs[k].tokens for k in refs)
        speedups = [max(refs[k].decode_s, FLOOR_S) / max(runs[k].decode_s, FLOOR_S) for k in refs]
        per_step = sum(r.tokens_per_step for r in runs.values()) / len(runs)
        return TrialOutcome(candidate.name, geomean(speedups) if match else 0.0, match, per_step,
                            "" if match else "output differs from AR on the trial prompts", outcome)


def trial_status(outcome: TrialOutcome) -> TrialStatus:
    if outcome.sandbox is not None and outcome.sandbox.status in STOPPING:
        return TrialStatus.STOPPED
    if outcome.sandbox is None or not outcome.sandbox.ok:
        return TrialStatus.NOT_RUN
    return TrialStatus.OK if outcome.tokens_match else TrialStatus.LOSSY


class LoggedSandboxTrial:
    """Agent code in the sandbox, its outcome also logged in explore's QuickBench as a Measurement against the
    build's latest baseline: from there it is selected, validated and integrated like any other candidate."""

    def __init__(self, trial: SandboxTrial, bench: QuickBench):
        self.trial, self.bench = trial, bench

    def __call__(self, candidate: Candidate) -> TrialOutcome:
        base = self.bench.latest_baseline()
        outcome = self.trial(candidate)
        self.bench.record(Measurement(candidate, outcome.speedup, base.objective, outcome.tokens_per_step,
                                      outcome.tokens_match, base.batch, outcome.error, trial_status(outcome)))
        return dataclasses.replace(outcome, baseline=base.objective)
