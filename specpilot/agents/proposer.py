"""The agent proposer: an LLM (Anthropic Messages API with tool use) that proposes config deltas and policy code.

It reads the attribution, trace summaries and the EngineConfig schema through tools, tries candidates on the
quick bench (policy code only in the sandbox), and submits candidates for validation. A session stops when
every submitted candidate is accepted, when the model stops by itself, or at the turn or cost budget (the
cost from each response's `usage` at configurable prices; a call whose bound would exceed the budget is not
made). Every request, response and tool execution is saved as JSON under the session's transcript directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from specpilot.agents.ledger import AgentBudget, CostMeter, Prices, Transcript
from specpilot.agents.sandbox import SandboxedPolicyRunner
from specpilot.agents.tools import (TOOLS, Proposal, ToolInputError, ToolName, attribution_summary,
                                    check_policy_code, knobs_and_hooks)
from specpilot.agents.trials import TrialOutcome
from specpilot.agents.workbench import Workbench
from specpilot.costmodel import Direction
from specpilot.engines.config import ConfigError
from specpilot.engines.traces import StepTrace
from specpilot.stages.candidate import Candidate, CandidateSource

if TYPE_CHECKING:
    import anthropic

    from specpilot.stages.proposers import ExploreContext

DEFAULT_MODEL = "claude-sonnet-4-6"
SYSTEM = """You tune a speculative-decoding engine. Outputs must stay exactly equal to the engine's own greedy
autoregressive output: every candidate is validated by token forcing against the stock build on held-out
prompts, and any changed token rejects it. Use the tools to read the cost model's attribution and the step
traces, list the EngineConfig knobs and policy extension points, try candidates on the quick bench, then
submit the most promising ones. Prefer config deltas; write policy code only where a knob cannot express the
idea. Policy code runs in an isolated sandbox without network access and may write only in its own directory."""


class StopReason(str, Enum):
    SUBMITTED = "submitted"  # every submitted candidate was accepted
    END_TURN = "end_turn"  # the model stopped calling tools
    TRUNCATED = "truncated"  # a response hit max_output_tokens
    MAX_TURNS = "max_turns"
    MAX_COST = "max_cost"
    API_ERROR = "api_error"


@dataclass(frozen=True)
class AgentSession:
    stop: StopReason
    turns: int
    usage: dict[str, Any]  # tokens and cost, CostMeter.to_dict()
    candidates: tuple[Candidate, ...]  # accepted submissions, for validation
    trials: tuple[TrialOutcome, ...]  # every quick-bench trial, in order
    rejected: tuple[tuple[str, str], ...]  # (proposal name, why) for submissions refused
    transcript: str

    @property
    def cost_usd(self) -> float:
        return float(self.usage["cost_usd"])

    def to_dict(self) -> dict[str, Any]:
        return {"stop": self.stop.value, "turns": self.turns, "usage": self.usage,
                "candidates": [c.to_dict() for c in self.candidates], "trials": [t.to_dict() for t in self.trials],
                "rejected": [{"name": n, "reason": r} for n, r in self.rejected], "transcript": self.transcript}


@dataclass
class _State:
    """Mutable state of one session (internal)."""

    trials: dict[tuple[str, str | None], TrialOutcome] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    submitted_all: bool = False


class AgentProposer:
    """Implements explore's Proposer protocol with an LLM; `available()` is False without a client."""

    source = CandidateSource.AGENT

    def __init__(self, client_factory: Callable[[], "anthropic.Anthropic"] | None, model: str = DEFAULT_MODEL,
                 budget: AgentBudget = AgentBudget(), workdir: str | Path = ".", *, prices: Prices = Prices(),
                 sandbox: SandboxedPolicyRunner | None = None, steps: Sequence[StepTrace] = ()):
        self.client_factory, self.model, self.budget, self.prices = client_factory, model, budget, prices
        self.workdir, self.sandbox, self.steps = Path(workdir), sandbox, tuple(steps)
        self.sessions: list[AgentSession] = []

    def available(self) -> bool:
        return self.client_factory is not None

    def propose(self, direction: Direction, context: "ExploreContext", n: int) -> list[Candidate]:
        if not self.available():
            return []
        return list(self.run(direction, Workbench.from_context(context, self.sandbox, self.steps), n).candidates)

    def run(self, direction: Direction, bench: Workbench, n: int) -> AgentSession:
        """One session for `direction`; up to `n` candidates."""
        if not self.available():
            raise RuntimeError("the agent proposer has no API client (set ANTHROPIC_API_KEY or inject a client)")
        stem = self.workdir / "agent" / f"{bench.name_prefix}-{direction.name.value}"
        transcript = Transcript(next(p for i in range(10_000) if not (p := Path(f"{stem}-{i:02d}")).exists()))
        client, meter, state = self.client_factory(), CostMeter(self.prices), _State()
        messages: list[dict[str, Any]] = [{"role": "user", "content": _brief(direction, bench, n)}]
        stop, turns = StopReason.MAX_TURNS, 0
        while turns < self.budget.max_turns:
            if meter.cost_usd + meter.next_call_bound(self.budget.max_output_tokens) > self.budget.max_cost_usd:
                stop = StopReason.MAX_COST
                break
            request = {"model": self.model, "max_tokens": self.budget.max_output_tokens, "system": SYSTEM,
                       "tools": list(TOOLS), "messages": messages}
            transcript.request(turns, request)
            try:
                response = client.messages.create(**request)
            except Exception as e:  # noqa: BLE001 - any SDK/transport failure ends the session, recorded
                transcript.error(turns, {"type": type(e).__name__, "message": str(e)})
                stop = StopReason.API_ERROR
                break
            turns += 1
            transcript.response(turns - 1, response.model_dump(mode="json"))
            meter.add(response.usage)
            messages.append({"role": "assistant", "content": [b.model_dump(mode="json", exclude_none=True)
                                                              for b in response.content]})
            uses = [b for b in response.content if b.type == "tool_use"]
            if response.stop_reason == "max_tokens":  # a tool call cut off mid-input must not run
                stop = StopReason.TRUNCATED
                break
            if not uses:
                stop = StopReason.END_TURN
                break
            calls, results = [], []
            for use in uses:
                body, is_error = self._tool(use.name, use.input, bench, state, n)
                calls.append({"id": use.id, "name": use.name, "input": use.input, "result": body, "is_error": is_error})
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": json.dumps(body),
                                "is_error": is_error})
            transcript.tools(turns - 1, calls)
            messages.append({"role": "user", "content": results})
            if state.submitted_all:
                stop = StopReason.SUBMITTED
                break
            if meter.cost_usd >= self.budget.max_cost_usd:
                stop = StopReason.MAX_COST
                break
        session = AgentSession(stop, turns, meter.to_dict(), tuple(state.candidates), tuple(state.trials.values()),
                               tuple(state.rejected), str(transcript.dir))
        transcript.session({**session.to_dict(), "model": self.model, "budget": vars(self.budget),
                            "direction": direction.name.value})
        self.sessions.append(session)
        return session

    # ---- tools ---------------------------------------------------------------------------------------------
    def _tool(self, name: str, data: Any, bench: Workbench, state: _State, n: int) -> tuple[Any, bool]:
        try:
            tool = ToolName(name)
        except ValueError:
            return {"error": f"unknown tool {name!r}"}, True
        try:
            if tool is ToolName.READ_ATTRIBUTION:
                return attribution_summary(bench.attribution), False
            if tool is ToolName.READ_TRACES:
                return (bench.traces.to_dict() if bench.traces else {"available": False}), False
            if tool is ToolName.LIST_KNOBS:
                return knobs_and_hooks(bench.base.config.to_dict()), False
            if tool is ToolName.TRY_CANDIDATE:
                return self._trial(self._candidate(Proposal.from_tool(data), bench), bench, state).for_agent(), False
            items = data.get("candidates") if isinstance(data, dict) else None
            if not isinstance(items, list) or not items:
                raise ToolInputError("submit_candidates needs a non-empty list `candidates`")
            return self._submit(items, bench, state, n), False
        except ToolInputError as e:
            return {"error": str(e)}, True

    def _candidate(self, p: Proposal, bench: Workbench) -> Candidate:
        from specpilot.stages import catalog

        try:
            config, label = bench.apply_delta(p.config_delta)
        except (ConfigError, ValueError, TypeError) as e:
            raise ToolInputError(f"config_delta {p.config_delta}: {e}") from None
        policy, mechanisms = None, catalog.mechanisms_in(bench.base, config, label)
        if p.policy is not None:
            if bench.sandbox is None:
                raise ToolInputError("policy code is not accepted in this run (no sandbox to run it in); "
                                     "propose config deltas")
            if problem := check_policy_code(p.policy):
                raise ToolInputError(problem)
            policy = bench.sandbox.write_policy(f"{bench.name_prefix}-{p.name}", p.policy.code, p.policy.class_name)
            mechanisms += (f"agent_policy:{p.policy.class_name}",)
        return Candidate(f"{bench.name_prefix}-{p.name}", config, policy, mechanisms, CandidateSource.AGENT, label)

    def _trial(self, candidate: Candidate, bench: Workbench, state: _State) -> TrialOutcome:
        key = (candidate.config.digest() + (candidate.drafter_label or ""), candidate.policy)
        if key not in state.trials:
            trial = bench.try_config if candidate.policy is None else bench.try_policy
            state.trials[key] = trial(candidate)
        return state.trials[key]

    def _submit(self, items: list[Any], bench: Workbench, state: _State, n: int) -> dict[str, Any]:
        report = []
        for item in items:
            name = item.get("name", "?") if isinstance(item, dict) else "?"
            try:
                candidate = self._candidate(Proposal.from_tool(item), bench)
            except ToolInputError as e:
                state.rejected.append((str(name), str(e)))
                report.append({"name": name, "accepted": False, "reason": str(e)})
                continue
            outcome = self._trial(candidate, bench, state)  # every submission is measured (sandboxed if code)
            if outcome.stopped_by_sandbox:
                reason = f"stopped by the sandbox: {outcome.error}"
            elif len(state.candidates) >= n:
                reason = f"only {n} candidates are taken this round"
            elif any(c.name == candidate.name for c in state.candidates):
                reason = "already submitted"
            else:
                state.candidates.append(candidate)
                report.append({"name": name, "accepted": True, "trial": outcome.for_agent()})
                continue
            state.rejected.append((candidate.name, reason))
            report.append({"name": name, "accepted": False, "reason": reason})
        state.submitted_all = all(r["accepted"] for r in report)
        return {"submitted": report}


def _brief(direction: Direction, bench: Workbench, n: int) -> str:
    return (f"Direction this round: {direction.name.value} (factor {direction.factor:.3f}, predicted gain "
            f"{direction.predicted_gain:.3f}). {direction.rationale}\n"
            f"Current build: {json.dumps(bench.base.config.to_dict())}, drafter {bench.base.drafter_label}.\n"
            f"Policy code: {'accepted (sandboxed)' if bench.sandbox else 'not accepted in this run'}.\n"
            f"Submit at most {n} candidate(s) with submit_candidates.")
