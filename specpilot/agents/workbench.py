"""What the agent's tools read and run for one exploration: the build, attribution, traces and trials."""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from specpilot.agents.sandbox import SandboxedPolicyRunner
from specpilot.agents.trials import CandidateTrial, LoggedSandboxTrial, QuickBenchTrial, SandboxTrial
from specpilot.costmodel import Attribution
from specpilot.engines.config import EngineConfig
from specpilot.engines.traces import StepTrace
from specpilot.stages.candidate import Candidate

if TYPE_CHECKING:
    from specpilot.stages.proposers import ExploreContext

DeltaApplier = Callable[[dict[str, Any]], tuple[EngineConfig, str | None]]


@dataclass(frozen=True)
class TraceSummary:
    """Step traces boiled down to what shapes a proposal: how much is drafted, how much of it is accepted."""

    steps: int
    requests: int
    tokens_per_step: float  # committed per verify step (accepted + bonus)
    drafted_per_step: float
    accepted_hist: dict[int, int]  # draft tokens accepted -> steps
    depth_hist: dict[int, int]  # deepest draft node -> steps
    acceptance_by_depth: dict[int, float]  # P(accepted >= d | drafted to depth >= d)
    draft_ms: float  # mean host drafting time per step
    verify_ms: float  # mean verify wall time per step

    @classmethod
    def from_steps(cls, steps: Sequence[StepTrace]) -> "TraceSummary":
        if not steps:
            raise ValueError("no step traces to summarise")
        by_depth = {}
        for d in range(1, max(s.depth for s in steps) + 1):
            reached = [s for s in steps if s.depth >= d]
            by_depth[d] = round(sum(s.accepted >= d for s in reached) / len(reached), 4)
        return cls(len(steps), len({s.request_id for s in steps}), statistics.fmean(s.committed for s in steps),
                   statistics.fmean(s.drafted for s in steps), dict(sorted(Counter(s.accepted for s in steps).items())),
                   dict(sorted(Counter(s.depth for s in steps).items())), by_depth,
                   1e3 * statistics.fmean(s.draft_s for s in steps), 1e3 * statistics.fmean(s.verify_s for s in steps))

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "requests": self.requests, "tokens_per_step": round(self.tokens_per_step, 3),
                "drafted_per_step": round(self.drafted_per_step, 3), "accepted_hist": self.accepted_hist,
                "depth_hist": self.depth_hist, "acceptance_by_depth": self.acceptance_by_depth,
                "draft_ms": round(self.draft_ms, 4), "verify_ms": round(self.verify_ms, 4)}


def plain_delta(base: Candidate) -> DeltaApplier:
    """Deltas over `base`'s config with its drafter (for factories without a deployment's drafter list)."""
    return lambda delta: (base.config.replace(**delta), base.drafter_label)


@dataclass(frozen=True)
class Workbench:
    base: Candidate  # the current build: deltas apply to it
    attribution: Attribution | None
    traces: TraceSummary | None
    try_config: CandidateTrial  # config-only candidates
    apply_delta: DeltaApplier
    sandbox: SandboxedPolicyRunner | None = None  # None: policy code is not accepted (nowhere safe to run it)
    try_policy: CandidateTrial | None = None  # candidates with agent code, in the sandbox
    name_prefix: str = "agent"

    def __post_init__(self) -> None:
        if (self.sandbox is None) != (self.try_policy is None):
            raise ValueError("policy code needs both a sandbox to store it in and a sandboxed trial to run it")

    @classmethod
    def from_context(cls, context: "ExploreContext", sandbox: SandboxedPolicyRunner | None = None,
                     steps: Sequence[StepTrace] = ()) -> "Workbench":
        """From explore's context: config trials through its QuickBench, code trials through the sandbox (logged
        in the QuickBench too), traces from `steps`, else from decoding the tune prompts once with the build."""
        from specpilot.stages import catalog

        bench, dep, p = context.evaluate, context.deployment, context.params
        if not steps:
            engine = bench.session.engine(context.base.config, context.base.drafter_label)
            steps = [s for t in bench.prompts for s in engine.generate(list(t.ids), bench.max_new_tokens, t.key).steps]
        policy_trial = None if sandbox is None else LoggedSandboxTrial(
            SandboxTrial(sandbox, bench.session, dep.ar_config(), bench.prompts, bench.max_new_tokens), bench)
        return cls(context.base, context.attribution, TraceSummary.from_steps(steps) if steps else None,
                   QuickBenchTrial(bench), lambda delta: catalog.apply_delta(dep, context.base, delta, None),
                   sandbox, policy_trial, f"agent-r{p.round}-d{p.device_index}")
