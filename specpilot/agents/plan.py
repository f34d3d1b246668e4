"""Which proposers the explore stage runs, and what it keeps of the agent's work.

Memory and search always run. The agent proposer joins them when an Anthropic client can be made: one
injected by the caller (tests replay recorded responses), else a key in the environment variable the settings
name (never the key itself: stage parameters are stored as artifacts). Its policy code gets a sandbox over the
session's target under the stage's scratch directory. Without a key the plan says the agent is off and why,
and the stage records that note. After the stage, `write_agent_outputs` flattens every session's transcript
(requests, responses, tool executions) and the agent's policy code into the stage's outputs.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from specpilot.agents.ledger import AgentBudget, Prices
from specpilot.agents.proposer import DEFAULT_MODEL, AgentProposer
from specpilot.agents.protocol import TargetSpec
from specpilot.agents.sandbox import SandboxedPolicyRunner, SandboxLimits
from specpilot.engines.config import DrafterKind
from specpilot.engines.traces import StepTrace
from specpilot.stages.candidate import Candidate
from specpilot.stages.proposers import MemoryProposer, Proposer, SearchProposer

if TYPE_CHECKING:
    import anthropic

    from specpilot.bench.session import DeploymentSession

API_KEY_ENV = "ANTHROPIC_API_KEY"
MODEL_ENV = "SPECPILOT_AGENT_MODEL"
AGENT_FILE = "agent.json"


def policy_file(candidate: str) -> str:
    """The output name under which explore publishes an agent candidate's code (integrate looks it up by this)."""
    from specpilot.stages.io import path_part

    return f"policy-{path_part(candidate)}.py"


class AgentStatus(str, Enum):
    ON = "on"
    NO_KEY = "off_no_key"  # the configured environment variable is unset or empty
    DISABLED = "off_disabled"  # no key variable configured: the agent is switched off for this run
    REGIME = "off_regime"  # a batch-regime deployment: the agent's trials and sandbox decode single requests


@dataclass(frozen=True)
class AgentSettings:
    key_env: str = API_KEY_ENV  # the environment variable that holds the API key ("" switches the agent off)
    model: str = ""  # "": $SPECPILOT_AGENT_MODEL, else DEFAULT_MODEL
    budget: AgentBudget = AgentBudget()
    prices: Prices = Prices()
    limits: SandboxLimits = SandboxLimits()


@dataclass(frozen=True)
class ProposerPlan:
    proposers: tuple[Proposer, ...]
    status: AgentStatus
    note: str  # one line for the log and the stage summary: which proposers run, and why the agent does or not
    agent: AgentProposer | None = None

    def summary(self) -> dict[str, Any]:
        sessions = self.agent.sessions if self.agent else []
        return {"status": self.status.value, "note": self.note, "model": self.agent.model if self.agent else None,
                "sessions": [{"stop": s.stop.value, "turns": s.turns, "cost_usd": s.cost_usd,
                              "submitted": [c.name for c in s.candidates],
                              "rejected": [{"name": n, "reason": r} for n, r in s.rejected]} for s in sessions]}


def sandbox_for_session(session: "DeploymentSession", root: str | Path,
                        limits: SandboxLimits = SandboxLimits()) -> SandboxedPolicyRunner:
    """A sandbox whose child loads the session's target (and its draft model) from disk, read-only."""
    from specpilot.deployments import resolve_model
    from specpilot.engines.loader import save_model

    root, dep = Path(root), session.deployment
    model_dir = session.target_dir
    if model_dir is None:  # random-weight targets exist only in memory: write them once for the child
        model_dir = root / "target"
        if not (model_dir / "config.json").is_file():
            save_model(session.target, model_dir)
    draft_dir = None
    spec = next((d for d in dep.drafters if d.kind is DrafterKind.DRAFT_MODEL and d.model is not None), None)
    if spec is not None:
        draft_dir = resolve_model(spec.model, session.cache)
        if draft_dir is None:
            draft_dir = save_model(session.draft_model(spec.label), root / "draft")
    target = TargetSpec(str(model_dir), dep.engine.dtype, session.device, tuple(sorted(session.eos)),
                        None if draft_dir is None else str(draft_dir))
    return SandboxedPolicyRunner(target, root / "sandbox", limits)


def plan_proposers(session: "DeploymentSession", workdir: str | Path, settings: AgentSettings = AgentSettings(), *,
                   client_factory: Callable[[], "anthropic.Anthropic"] | None = None,
                   steps: Sequence[StepTrace] = ()) -> ProposerPlan:
    """Memory and search always; the agent too when a client can be made. `workdir`: scratch for the agent's
    transcripts and sandbox (outside the stage's flat output directory)."""
    proposers: tuple[Proposer, ...] = (MemoryProposer(), SearchProposer())
    if session.deployment.batched:
        return ProposerPlan(proposers, AgentStatus.REGIME, "agent proposer off: its trials and sandbox decode single "
                            "requests, and this deployment is served batched; exploring with the search and memory "
                            "proposers only")
    if client_factory is None:
        if not settings.key_env:
            return ProposerPlan(proposers, AgentStatus.DISABLED, "agent proposer off: no API key variable configured "
                                "(agent_key_env is empty); exploring with the search and memory proposers only")
        key = os.environ.get(settings.key_env, "").strip()
        if not key:
            return ProposerPlan(proposers, AgentStatus.NO_KEY, f"agent proposer off: ${settings.key_env} is not set; "
                                "exploring with the search and memory proposers only")
        import anthropic

        client_factory = functools.partial(anthropic.Anthropic, api_key=key, max_retries=2)
    model = settings.model or os.environ.get(MODEL_ENV) or DEFAULT_MODEL
    sandbox = sandbox_for_session(session, Path(workdir) / "agent", settings.limits)
    agent = AgentProposer(client_factory, model, settings.budget, workdir, prices=settings.prices, sandbox=sandbox,
                          steps=steps)
    b = settings.budget
    return ProposerPlan(proposers + (agent,), AgentStatus.ON,
                        f"agent proposer on: model {model}, at most {b.max_turns} turns and ${b.max_cost_usd:g} per "
                        f"session; its policy code runs in a {sandbox.isolation.value} sandbox under {sandbox.root}; "
                        "search and memory proposers run too", agent)


def write_agent_outputs(plan: ProposerPlan, out_dir: Path, measured: Sequence[Candidate]) -> list[str]:
    """agent.json (the plan's note and every session), each session's transcript files flattened as
    `<session>-<file>`, and the code of every agent candidate measured as `policy-<candidate>.py`; returns the
    file names written."""
    sessions = plan.agent.sessions if plan.agent else []
    body = {**plan.summary(), "sessions": [s.to_dict() for s in sessions]}
    (out_dir / AGENT_FILE).write_text(json.dumps(body, indent=1))
    written = [AGENT_FILE]
    for s in sessions:
        directory = Path(s.transcript)
        for f in sorted(directory.iterdir()):
            written.append(shutil.copyfile(f, out_dir / f"{directory.name}-{f.name}").name)
    for c in measured:
        if c.runs_isolated and Path(code := c.policy.rsplit(":", 1)[0]).is_file():
            written.append(shutil.copyfile(code, out_dir / policy_file(c.name)).name)
    return written
