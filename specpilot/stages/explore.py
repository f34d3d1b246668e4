"""Explore: for one direction on one device, propose candidates and quick-benchmark them by real decoding.

Proposers (stages/proposers.py) turn the direction and context into candidates: memory's first (decoded in
the first batch, warm-starting the search), then the search, then the agent when an API key exists
(agents/plan.py decides, and the stage records why it is on or off). Every candidate becomes a Measurement
in the QuickBench log (stages/quickbench.py; batch-regime deployments: stages/batch_quickbench.py, batched
throughput at the deployment's concurrencies); agent code only ever runs in the sandbox, whose outcomes join
the same log. Selected for validation: the candidates that beat the build in their own bench run without
differing from AR, plus every candidate owed a verdict that ran: memory's (a transfer to this scope needs
one, carried over or not) and the agent's submissions (its tool hands them to validation).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from specpilot.agents.ledger import AgentBudget
from specpilot.agents.plan import AgentSettings, plan_proposers, write_agent_outputs
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.costmodel import Attribution, Direction, DirectionName
from specpilot.deployments import RegimeKind
from specpilot.engines.traces import StepTrace
from specpilot.stages import catalog
from specpilot.stages.batch_quickbench import BatchQuickBench
from specpilot.stages.candidate import Candidate, CandidateSource
from specpilot.stages.devices import exclusive
from specpilot.stages.io import SplitName, StageRun, memory_scope
from specpilot.stages.proposers import (ExploreContext, MemoryHit, MemoryProposer, Proposer, SearchProposer,
                                        recall_memory)
from specpilot.stages.quickbench import Measurement, QuickBench, TrialStatus
from specpilot.stats import geomean_of_runs

if TYPE_CHECKING:
    import anthropic

log = logging.getLogger(__name__)
OWED_A_VERDICT = (CandidateSource.MEMORY, CandidateSource.AGENT)


@dataclass(frozen=True)
class ExploreParams:
    round: int = 1
    device_index: int = 0
    prompts: int = 2  # tune prompts in the quick bench
    max_new_tokens: int = 16  # per quick-bench request
    trials: int = 8  # search trials (memory candidates and the baseline come on top)
    batch: int = 4  # trials decoded per bench run (one AR reference per batch)
    repeats: int = 1  # bench runs per batch; each request keeps its fastest
    keep: int = 2  # candidates that beat the build handed to validation; also the agent's submissions
    memory_candidates: int = 3
    seed: int = 0
    agent_key_env: str = "ANTHROPIC_API_KEY"  # the variable holding the API key, never the key ("" = agent off)
    agent_model: str = ""  # "": $SPECPILOT_AGENT_MODEL, else the agent's default model
    agent_max_turns: int = 12  # Messages API calls per agent session
    agent_max_cost_usd: float = 2.0  # per agent session

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExploreParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def agent_settings(self) -> AgentSettings:
        return AgentSettings(self.agent_key_env, self.agent_model,
                             AgentBudget(max_turns=self.agent_max_turns, max_cost_usd=self.agent_max_cost_usd))


@dataclass(frozen=True)
class ExploreResult:
    direction: DirectionName
    baseline: Measurement  # the build; objective = geomean of its speedup vs AR over the bench runs
    measured: tuple[Measurement, ...]  # memory candidates first, then search trials, then the agent's, in order
    selected: tuple[Measurement, ...]  # for validation (see the module docstring)
    memory_first: tuple[str, ...]  # the memory candidates, measured before any search trial
    owed: tuple[str, ...]  # candidates owed a verdict (memory's, the agent's submissions), selected if they ran
    space: catalog.SearchSpace
    requests: tuple[dict[str, Any], ...]  # every in-process quick-bench request


def select(log_: list[Measurement], owed: set[str], keep: int) -> tuple[Measurement, ...]:
    """Up to `keep` that beat the build in their own bench run without differing from AR (largest gain first),
    then every candidate named in `owed` that ran to the end, lossy or not: token forcing gives it its verdict."""
    selected: dict[tuple[str, str | None, str | None], Measurement] = {}
    for m in sorted(log_, key=lambda m: -m.objective / max(m.baseline, 1e-9)):
        if m.beats_baseline and m.key not in selected and len(selected) < keep:
            selected[m.key] = m
    for m in log_:
        if m.candidate.name in owed and m.ran and m.key not in selected:
            selected[m.key] = m
    return tuple(selected.values())


def explore(session: DeploymentSession, base: Candidate, direction: Direction, prompts: list[TokenizedPrompt],
            params: ExploreParams, memory_hits: tuple[MemoryHit, ...] = (), attribution: Attribution | None = None,
            proposers: tuple[Proposer, ...] = (MemoryProposer(), SearchProposer())) -> ExploreResult:
    """Memory's candidates first (decoded in the first batch), then the other proposers in order."""
    space = catalog.search_space(session.deployment, base, direction.name, min_settings=2 * params.trials)
    # The batch regime measures builds as they serve: batched, at the deployment's concurrencies.
    bench_type = BatchQuickBench if session.deployment.regime.kind is RegimeKind.BATCH else QuickBench
    bench = bench_type(session, prompts, params.max_new_tokens, base, params.repeats)
    ctx = ExploreContext(session.deployment, base, attribution, space, tuple(memory_hits), bench, params)
    first = [c for pr in proposers if pr.source is CandidateSource.MEMORY
             for c in pr.propose(direction, ctx, params.memory_candidates)]
    bench.enqueue(first)
    owed = {c.name for c in first}
    for pr in proposers:
        if pr.source is not CandidateSource.MEMORY:
            proposed = pr.propose(direction, ctx, params.keep)
            owed |= {c.name for c in proposed} if pr.source in OWED_A_VERDICT else set()
    bench.flush()
    if not bench.baselines:  # nothing to try at all: still measure the build
        bench([])
    baseline = dataclasses.replace(bench.baselines[0], objective=geomean_of_runs(b.objective for b in bench.baselines))
    return ExploreResult(direction.name, baseline, tuple(bench.log), select(bench.log, owed, params.keep),
                         tuple(c.name for c in first), tuple(sorted(owed)), space, tuple(bench.rows))


def write_explore(result: ExploreResult, out_dir: Path) -> None:
    (out_dir / "candidates.json").write_text(json.dumps({
        "direction": result.direction.value, "baseline": result.baseline.to_dict(),
        "memory_first": list(result.memory_first),
        "selected": [m.to_dict() for m in result.selected]}, indent=1))
    (out_dir / "measurements.json").write_text(json.dumps([m.to_dict() for m in result.measured], indent=1))
    (out_dir / "search_space.json").write_text(json.dumps(result.space.to_dict(), indent=1))
    pq.write_table(pa.Table.from_pylist(list(result.requests)), out_dir / "measurements.parquet")


def transfers(result: ExploreResult, hits: tuple[MemoryHit, ...]) -> list[dict[str, Any]]:
    """Memory's candidates with the mechanism each applies and where it was proven: integrate records whether
    each carried over to this scope."""
    by_name = {h.name: h for h in hits}
    return [{"candidate": m.candidate.name, "status": m.status.value, "objective": m.objective,
             "baseline": m.baseline, "error": m.error, "hit": by_name[m.candidate.mechanisms[0]].to_dict()}
            for m in result.measured if m.candidate.source is CandidateSource.MEMORY
            and m.candidate.mechanisms and m.candidate.mechanisms[0] in by_name]


def run_recall(run: StageRun) -> dict[str, Any]:
    dep, build = run.deployment, Candidate.from_dict(run.param("build"))
    scope = memory_scope(dep, build.drafter_label, run.device)
    hits = recall_memory(run.param("memory"), scope, int(run.param("limit", 10)))
    (run.out_dir / "memory_hits.json").write_text(json.dumps([h.to_dict() for h in hits], indent=1))
    return {"scope": asdict(scope), "hits": [h.name for h in hits]}


def run(run: StageRun, *, client_factory: Callable[[], "anthropic.Anthropic"] | None = None) -> dict[str, Any]:
    """The stage. `client_factory`: an Anthropic client for the agent proposer made in-process (tests replay
    recorded responses through it); without one, the agent runs when params.agent_key_env names a set key."""
    params = ExploreParams.from_dict(run.request.params)
    base = Candidate.from_dict(run.read_json("profile", "build.json"))
    attribution = Attribution.from_dict(run.read_json("attribute", "attribution.json"))
    wanted = run.param("direction")
    direction = next(d for d in attribution.directions if wanted in (None, d.name.value))
    recalled = run.read_json("recall", "memory_hits.json") if run.roles("recall") else []
    hits = tuple(MemoryHit.from_dict(h) for h in recalled)
    prompts = run.prompts(SplitName.TUNE, params.prompts)
    steps = [StepTrace(**row) for row in run.read_table("profile", "steps.parquet").to_pylist()]
    session = run.session()
    plan = plan_proposers(session, run.scratch, params.agent_settings(), client_factory=client_factory, steps=steps)
    log.info("explore %s: %s", " ".join(run.request.qualifiers), plan.note)
    with exclusive(run.device):
        result = explore(session, base, direction, prompts, params, hits, attribution, plan.proposers)
    write_explore(result, run.out_dir)
    agent_files = write_agent_outputs(plan, run.out_dir, [m.candidate for m in result.measured])
    return {"direction": result.direction.value, "baseline": result.baseline.objective, "tried": len(result.measured),
            "memory_first": list(result.memory_first), "widened": result.space.widened,
            "selected": [m.to_dict() for m in result.selected], "owed_a_verdict": list(result.owed),
            "lossy": [m.to_dict() for m in result.measured if not m.matches_ar],
            "stopped": [m.candidate.name for m in result.measured if m.status is TrialStatus.STOPPED],
            "transfers": transfers(result, hits), "agent": {**plan.summary(), "files": agent_files}}
