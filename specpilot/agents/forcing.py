"""Token forcing for candidates whose policy is agent code: stock runs here, the candidate in the sandbox.

The same checks as stages/validate, with the candidate's half moved into child processes:
1. free-running: a child decodes the held-out prompts without ever seeing a reference; its tokens must equal
   the stock build's, which this process decodes itself;
2. a suspiciously large speedup is measured again (stock here, the candidate in a fresh child);
3. forced: a last, fresh child feeds the stock sequences through the candidate's target (its config and its
   weight transform) and reports argmax, runner-up and margin per position; compared here with the stock
   build's own forced pass, with validate's tie rule.
A sandbox that stopped the code (violation, limit, crash) rejects the candidate with that reason. What the
child reports in step 3 is only as honest as the child, but step 1 alone already rejects any lossy output:
it cannot match stock without computing what stock computes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from specpilot.agents.plan import sandbox_for_session
from specpilot.agents.protocol import PromptIds, SandboxOutcome
from specpilot.agents.sandbox import SandboxedPolicyRunner, SandboxLimits
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.stages.candidate import Candidate
from specpilot.stages.validate import (EngineFactory, ForcedPass, PromptMargins, PromptRow, SpeedupCheck, Verdict,
                                       VerdictKind, forced_pass, forced_runner, write_verdict)
# validate's comparison rules themselves, so both paths judge by one definition of a flip and a tie.
from specpilot.stages.validate import DivergenceKind, _classify, _first_mismatch, _forced_flips, _reasons, _speedup


SANDBOX_VERDICT = "sandbox_verdict.json"


@dataclass(frozen=True)
class SandboxedVerdict:
    candidate: str
    verdict: Verdict | None  # None when the sandbox stopped the code before token forcing could finish
    outcomes: tuple[SandboxOutcome, ...]  # every child run, in order
    rejected: str = ""  # why the sandbox stopped it ("" when it ran)

    @property
    def kind(self) -> VerdictKind:
        return VerdictKind.FAIL if self.rejected or self.verdict is None else self.verdict.kind

    @property
    def passed(self) -> bool:
        return self.kind is VerdictKind.PASS

    @property
    def reasons(self) -> tuple[str, ...]:
        return ((self.rejected,) if self.rejected else ()) + (self.verdict.reasons if self.verdict else ())

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "kind": self.kind.value, "rejected": self.rejected,
                "reasons": list(self.reasons), "verdict": self.verdict.to_dict() if self.verdict else None,
                "sandbox": [o.to_dict() for o in self.outcomes]}


def validate_sandboxed(factory: EngineFactory, stock: Candidate, candidate: Candidate,
                       prompts: Sequence[TokenizedPrompt], max_new_tokens: int, tie_epsilon: float,
                       runner: SandboxedPolicyRunner, *, speedup_threshold: float = 20.0) -> SandboxedVerdict:
    if not prompts:
        raise ValueError("validate needs at least one held-out prompt")
    if tie_epsilon < 0 or max_new_tokens < 1:
        raise ValueError(f"tie_epsilon={tie_epsilon} must be >= 0 and max_new_tokens={max_new_tokens} >= 1")
    ids = [PromptIds(p.key, tuple(p.ids)) for p in prompts]
    stock_engine = factory.engine(stock.config, stock.drafter_label, stock.load_policy())
    stock_engine.warm_up(list(prompts[0].ids), min(2, max_new_tokens))  # as the child does
    stock_runs = [stock_engine.generate(list(p.ids), max_new_tokens, p.key) for p in prompts]
    outcomes: list[SandboxOutcome] = []

    def child_runs(outcome: SandboxOutcome) -> dict[str, Any] | str:
        outcomes.append(outcome)
        if not outcome.ok:
            return outcome.reason()
        got = {r.key: r for r in (outcome.runs or outcome.forced)}
        missing = [p.key for p in prompts if p.key not in got]
        return f"sandbox result lacks prompts {missing}" if missing else got

    def rejected(reason: str) -> SandboxedVerdict:
        return SandboxedVerdict(candidate.name, None, tuple(outcomes), reason)

    free = child_runs(runner.generate(candidate, ids, max_new_tokens))
    if isinstance(free, str):
        return rejected(free)
    check = SpeedupCheck(speedup_threshold, tuple(_speedup(s, free[p.key]) for s, p in zip(stock_runs, prompts)))
    rerun = None
    if check.geomean > speedup_threshold:  # suspiciously fast: measure both again, check the outputs again
        stock_again = [stock_engine.generate(list(p.ids), max_new_tokens, p.key) for p in prompts]
        rerun = child_runs(runner.generate(candidate, ids, max_new_tokens))
        if isinstance(rerun, str):
            return rejected(rerun)
        check = SpeedupCheck(speedup_threshold, check.first,
                             tuple(_speedup(s, rerun[p.key]) for s, p in zip(stock_again, prompts)))
    forced = child_runs(runner.forced(candidate, ids, {p.key: s.tokens for p, s in zip(prompts, stock_runs)}))
    if isinstance(forced, str):
        return rejected(forced)
    ref_runner = forced_runner(stock_engine)
    rows, divergences, margins = [], [], []
    for i, (p, s_run) in enumerate(zip(prompts, stock_runs)):
        c_run, f = free[p.key], forced[p.key]
        if len(f.argmax) != len(s_run.tokens):
            return rejected(f"{p.key}: the sandbox's forced pass has {len(f.argmax)} positions, stock output "
                            f"{len(s_run.tokens)}")
        ref = forced_pass(ref_runner, p.ids, s_run.tokens, max_new_tokens)
        flips = _forced_flips(p.key, s_run.tokens, ref, ForcedPass(f.argmax, f.runner_up, f.margin), tie_epsilon)
        tie_at = {d.index for d in flips if d.tie}
        first = _first_mismatch(DivergenceKind.FREE_RUNNING, p.key, s_run.tokens, list(c_run.tokens), tie_at)
        again = None if rerun is None else _first_mismatch(DivergenceKind.RERUN, p.key, s_run.tokens,
                                                          list(rerun[p.key].tokens), tie_at)
        divergences += [d for d in (first, again) if d is not None] + flips
        margins.append(PromptMargins(p.key, ref.margin, f.margin))
        rows.append(PromptRow(p.key, len(p.ids), len(s_run.tokens), len(c_run.tokens), s_run.stop_reason,
                              c_run.stop_reason, None if first is None else first.index,
                              sum(d.kind is DivergenceKind.FORCED for d in flips), len(tie_at), min(ref.margin),
                              check.first[i]))
    verdict = Verdict(_classify(divergences), stock.name, candidate.name, tie_epsilon, max_new_tokens, tuple(rows),
                      tuple(divergences), tuple(margins), check, _reasons(divergences, check, tie_epsilon),
                      type(ref_runner).__name__)
    return SandboxedVerdict(candidate.name, verdict, tuple(outcomes))


def validate_isolated(session: DeploymentSession, stock: Candidate, candidate: Candidate,
                      prompts: Sequence[TokenizedPrompt], max_new_tokens: int, tie_epsilon: float, root: Path,
                      limits: SandboxLimits = SandboxLimits()) -> SandboxedVerdict:
    """The validate stage's path for agent code: a sandbox over the session's target under `root` (the stage's
    scratch). Code that is not where the candidate says (explore ran on another host) rejects it, with why."""
    code = candidate.policy.rsplit(":", 1)[0] if candidate.policy else ""
    if code.endswith(".py") and not Path(code).is_file():
        return SandboxedVerdict(candidate.name, None, (), f"policy code {code} is not on this host")
    runner = sandbox_for_session(session, root, limits)
    return validate_sandboxed(session, stock, candidate, prompts, max_new_tokens, tie_epsilon, runner)


def write_sandboxed_verdict(result: SandboxedVerdict, out_dir: Path) -> None:
    """sandbox_verdict.json (every child run, and why it was stopped), plus validate's verdict files when token
    forcing got as far as a verdict."""
    (out_dir / SANDBOX_VERDICT).write_text(json.dumps(result.to_dict(), indent=1))
    if result.verdict is not None:
        write_verdict(result.verdict, out_dir)
