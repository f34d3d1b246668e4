"""Explore's proposers: each turns a direction and context into candidates, measured on the quick bench.

MEMORY proposes mechanisms proven on similar scopes (their config deltas applied to this deployment's stock
build); SEARCH optimises the catalog's knobs with Optuna (TPE, seeded, a trial budget), each trial decoded on
the tune prompts with objective = the geometric-mean speedup vs AR (outputs differing from AR score 0). The
AGENT proposer (an LLM, specpilot.agents) implements the same protocol; specpilot.agents.plan decides whether
it runs. Memory is read here read-only; only integrate writes it.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import optuna
from tqdm import tqdm

from specpilot.costmodel import Attribution, Direction
from specpilot.deployments import Deployment
from specpilot.engines.config import ConfigError
from specpilot.memory import Memory, Scope, default_memory_path
from specpilot.memory.transfer import failed_transfers
from specpilot.stages import catalog, search_params
from specpilot.stages.batch_catalog import apply_batch_delta, split_delta
from specpilot.stages.candidate import Candidate, CandidateSource
from specpilot.stages.quickbench import QuickBench

if TYPE_CHECKING:
    from specpilot.stages.explore import ExploreParams

optuna.logging.set_verbosity(optuna.logging.WARNING)


# ---- memory: what was proven on similar scopes -----------------------------------------------------------
@dataclass(frozen=True)
class MemoryHit:
    name: str
    category: str
    description: str
    config_delta: dict[str, Any]  # relative to the stock build of the deployment it was proven on
    score: int  # scope similarity
    matched: tuple[str, ...]
    best_gain: float
    proven_on: dict[str, str]
    proven_in_run: str
    code_ref: str | None = None  # the mechanism's policy code, if it has any

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MemoryHit":
        return cls(**{**d, "matched": tuple(d["matched"])})

    @property
    def agent_code(self) -> bool:
        """Policy code in a file (an agent's): it runs only in the sandbox, so memory does not re-propose it."""
        return self.code_ref is not None and self.code_ref.rsplit(":", 1)[0].endswith(".py")


def recall_memory(path: str | Path | None, scope: Scope, limit: int = 10) -> tuple[MemoryHit, ...]:
    """Mechanisms with passing evidence, most similar scope first, without those whose transfer to this very
    scope failed before; none when the memory file does not exist yet."""
    resolved = Path(path).expanduser() if path else default_memory_path()
    if not resolved.exists():
        return ()
    with Memory.open(resolved, read_only=True) as memory:
        failed = failed_transfers(memory, scope)
        ranked = [r for r in memory.retrieve(scope, limit=limit + len(failed)) if r.mechanism.name not in failed]
    return tuple(MemoryHit(r.mechanism.name, r.mechanism.category.value, r.mechanism.description,
                           r.mechanism.config_delta, r.score, r.matched, r.best_gain, asdict(r.proven_on),
                           r.proven_in_run, r.mechanism.code_ref) for r in ranked[:limit])


# ---- the protocol ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExploreContext:
    deployment: Deployment
    base: Candidate  # the current build
    attribution: Attribution | None
    space: catalog.SearchSpace
    memory_hits: tuple[MemoryHit, ...]
    evaluate: QuickBench
    params: "ExploreParams"


class Proposer(Protocol):
    source: CandidateSource

    def propose(self, direction: Direction, context: ExploreContext, n: int) -> list[Candidate]: ...


class MemoryProposer:
    """Mechanisms proven on similar scopes, their config deltas (and our own policy code) applied to this
    deployment's stock build. A batching mechanism (a delta with BatchConfig fields) applies to batch-regime
    deployments only."""

    source = CandidateSource.MEMORY

    def propose(self, direction: Direction, context: ExploreContext, n: int) -> list[Candidate]:
        dep, p = context.deployment, context.params
        stock = catalog.stock_candidate(dep)
        seen = {(context.base.build_digest, context.base.drafter_label, context.base.policy)}
        out = []
        for hit in context.memory_hits:
            if hit.agent_code:
                continue  # the agent re-proposes its own code; memory never runs it
            try:
                engine_delta, batch_delta = split_delta(hit.config_delta)
                config, label = catalog.apply_delta(dep, stock, engine_delta, None)
                c = Candidate(f"memory-r{p.round}-d{p.device_index}-{len(out)}", config, hit.code_ref,
                              mechanisms=(hit.name,), source=self.source, drafter_label=label,
                              batch_config=apply_batch_delta(dep, stock.batch_config, batch_delta))
            except (ConfigError, ValueError):
                continue  # needs a drafter, field or serving regime this deployment does not have
            if (c.build_digest, label, hit.code_ref) in seen or len(out) >= n:
                continue
            seen.add((c.build_digest, label, hit.code_ref))
            out.append(c)
        return out


class SearchProposer:
    """Optuna TPE over the round's search space (seeded, a trial budget), trials decoded in batches; what other
    proposers measured (memory's candidates, the baseline) is told to the study as completed trials."""

    source = CandidateSource.SEARCH

    def propose(self, direction: Direction, context: ExploreContext, n: int) -> list[Candidate]:
        p, bench = context.params, context.evaluate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=p.seed * 1009 + p.round * 101 + p.device_index,
                                                 n_startup_trials=max(2, p.trials // 3), multivariate=True,
                                                 group=True, constant_liar=True)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        told: set[str] = set()
        bar = tqdm(total=p.trials, desc=f"explore {direction.name.value} r{p.round} dev{p.device_index}", unit="trial")
        asked = 0
        while asked < p.trials:
            pending: list[tuple[optuna.Trial, Candidate]] = []
            repeats: list[tuple[optuna.Trial, tuple[str, str]]] = []
            while asked < p.trials and len(pending) < p.batch:
                trial, asked = study.ask(), asked + 1
                try:
                    config, label, batch = search_params.suggest(trial, context.deployment, context.base, context.space)
                except (ConfigError, ValueError):
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    bar.update()
                    continue
                candidate = Candidate(f"search-r{p.round}-d{p.device_index}-t{trial.number}", config,
                                      mechanisms=catalog.mechanisms_in(context.base, config, label, batch=batch),
                                      source=self.source, drafter_label=label, batch_config=batch)
                key = (candidate.build_digest, label)
                if (earlier := bench.measured(*key)) is not None:
                    study.tell(trial, earlier.objective)
                    bar.update()
                elif any((c.build_digest, c.drafter_label) == key for _, c in pending):
                    repeats.append((trial, key))
                else:
                    pending.append((trial, candidate))
            for (trial, _), m in zip(pending, bench([c for _, c in pending]) if pending else []):
                study.tell(trial, m.objective)
            for trial, key in repeats:
                study.tell(trial, bench.measured(*key).objective)
            self._tell_others(study, context, told)
            bar.update(len(pending) + len(repeats))
        bar.close()
        ranked = sorted((m for m in bench.log if m.candidate.source is self.source and m.matches_ar),
                        key=lambda m: -m.objective)
        return [m.candidate for m in ranked[:n]]

    def _tell_others(self, study: optuna.Study, context: ExploreContext, told: set[str]) -> None:
        """Warm start: the baseline and other proposers' measured configs (without policy code: a policy is not
        a point of this space), where the space can express them."""
        bench = context.evaluate
        for m in [*bench.baselines[:1], *bench.log]:
            if m.candidate.source is self.source or m.candidate.policy is not None or m.candidate.name in told:
                continue
            told.add(m.candidate.name)
            label = m.candidate.drafter_label
            params = search_params.params_of(m.candidate.config, label, context.deployment, context.base, context.space,
                                             m.candidate.batch_config)
            if params is not None:
                study.add_trial(optuna.trial.create_trial(params=params, value=m.objective,
                                                          distributions=search_params.distributions(context.space, label)))
