"""Explore: for one direction on one device, propose candidates and quick-benchmark them by real decoding.

Proposers turn a direction and context into candidates. MEMORY proposes mechanisms proven on similar scopes
(their config deltas applied to this deployment); SEARCH optimises the catalog's knobs with Optuna (TPE,
seeded, a trial budget), each trial decoded on the tune prompts (short generations) with objective = the
geometric-mean speedup vs AR; outputs differing from AR score 0. Memory candidates are measured first and
warm-start the search. The build's own config is measured beside them as the baseline to beat.
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import optuna
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from specpilot.bench.harness import AR_LABEL, BenchReport, RequestResult, Variant, run_bench
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.costmodel import Attribution, Direction, DirectionName
from specpilot.deployments import Deployment
from specpilot.engines.config import ConfigError
from specpilot.memory import Memory, Scope, default_memory_path
from specpilot.stages import catalog
from specpilot.stages.candidate import Candidate, CandidateSource
from specpilot.stages.io import SplitName, StageRun, exclusive, memory_scope

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class ExploreParams:
    round: int = 1
    device_index: int = 0
    prompts: int = 2  # tune prompts in the quick bench
    max_new_tokens: int = 16  # per quick-bench request
    trials: int = 8  # search trials (memory candidates and the baseline come on top)
    batch: int = 4  # trials decoded per bench run (one AR reference per batch)
    repeats: int = 1  # bench runs per batch; each request keeps its fastest
    keep: int = 2  # candidates handed to validation
    memory_candidates: int = 3
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExploreParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Measurement:
    candidate: Candidate
    objective: float  # geomean speedup vs AR on the quick bench; 0 if lossy vs AR or not buildable
    baseline: float  # the current build's geomean speedup vs AR in the same bench run
    tokens_per_step: float
    matches_ar: bool
    batch: int
    error: str = ""

    @property
    def beats_baseline(self) -> bool:
        return self.matches_ar and self.objective > self.baseline

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.to_dict(), "objective": self.objective, "baseline": self.baseline,
                "tokens_per_step": self.tokens_per_step, "matches_ar": self.matches_ar, "batch": self.batch,
                "error": self.error}

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
                return Measurement(c, 0.0, base, 0.0, False, batch, failed[c.name])
            ok = all(r.all_match(label) for r in reports)
            speedups = [fastest[(AR_LABEL, key)].decode_s / max(req.decode_s, 1e-9)
                        for (variant, key), req in fastest.items() if variant == label]
            steps = [req.tokens_per_step for (variant, _), req in fastest.items() if variant == label]
            return Measurement(c, _geomean(speedups) if ok else 0.0, base, sum(steps) / len(steps), ok, batch,
                               "" if ok else "output differs from AR on the tune prompts")

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
        """One short generation per engine, once: one-time costs (allocation, graph capture) stay out of timings."""
        if id(engine) not in self._warmed:
            engine.generate(list(self.prompts[0].ids), 2)
            self._warmed.add(id(engine))

    def measured(self, config_digest: str, label: str | None) -> Measurement | None:
        return next((m for m in [*self.baselines[:1], *self.log] if m.candidate.config.digest() == config_digest
                     and m.candidate.drafter_label == label), None)


# ---- memory: what was proven on similar scopes (read-only; only integrate writes) ---------------------------
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

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MemoryHit":
        return cls(**{**d, "matched": tuple(d["matched"])})


def recall_memory(path: str | Path | None, scope: Scope, limit: int = 10) -> tuple[MemoryHit, ...]:
    """Mechanisms with passing evidence, most similar scope first; none when the memory file does not exist yet."""
    resolved = Path(path).expanduser() if path else default_memory_path()
    if not resolved.exists():
        return ()
    with Memory.open(resolved, read_only=True) as memory:
        ranked = memory.retrieve(scope, limit=limit)
    return tuple(MemoryHit(r.mechanism.name, r.mechanism.category.value, r.mechanism.description,
                           r.mechanism.config_delta, r.score, r.matched, r.best_gain, asdict(r.proven_on),
                           r.proven_in_run) for r in ranked)


def run_recall(run: StageRun) -> dict[str, Any]:
    dep, build = run.deployment, Candidate.from_dict(run.param("build"))
    scope = memory_scope(dep, build.drafter_label, run.device)
    hits = recall_memory(run.param("memory"), scope, int(run.param("limit", 10)))
    (run.out_dir / "memory_hits.json").write_text(json.dumps([h.to_dict() for h in hits], indent=1))
    return {"scope": asdict(scope), "hits": [h.name for h in hits]}


# ---- proposers --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExploreContext:
    deployment: Deployment
    base: Candidate  # the current build
    attribution: Attribution | None
    space: catalog.SearchSpace
    memory_hits: tuple[MemoryHit, ...]
    evaluate: QuickBench
    params: ExploreParams


class Proposer(Protocol):
    source: CandidateSource

    def propose(self, direction: Direction, context: ExploreContext, n: int) -> list[Candidate]: ...


class MemoryProposer:
    """Mechanisms proven on similar scopes, their config deltas applied to this deployment's stock build."""

    source = CandidateSource.MEMORY

    def propose(self, direction: Direction, context: ExploreContext, n: int) -> list[Candidate]:
        dep, p = context.deployment, context.params
        stock = catalog.stock_candidate(dep)
        seen = {(context.base.config.digest(), context.base.drafter_label)}
        out = []
        for hit in context.memory_hits:
            try:
                config, label = catalog.apply_delta(dep, stock, hit.config_delta, None)
            except (ConfigError, ValueError):
                continue  # needs a drafter or field this deployment does not have
            if (config.digest(), label) in seen or len(out) >= n:
                continue
            seen.add((config.digest(), label))
            out.append(Candidate(f"memory-r{p.round}-d{p.device_index}-{len(out)}", config, mechanisms=(hit.name,),
                                 source=self.source, drafter_label=label))
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
                    config, label = catalog.suggest(trial, context.deployment, context.base, context.space)
                except (ConfigError, ValueError):
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    bar.update()
                    continue
                key = (config.digest(), label)
                if (earlier := bench.measured(*key)) is not None:
                    study.tell(trial, earlier.objective)
                    bar.update()
                elif any((c.config.digest(), c.drafter_label) == key for _, c in pending):
                    repeats.append((trial, key))
                else:
                    pending.append((trial, Candidate(f"search-r{p.round}-d{p.device_index}-t{trial.number}", config,
                                                     mechanisms=catalog.mechanisms_in(context.base, config, label),
                                                     source=self.source, drafter_label=label)))
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
        """Warm start: the baseline and other proposers' measured candidates, where the space can express them."""
        bench = context.evaluate
        for m in [*bench.baselines[:1], *bench.log]:
            if m.candidate.source is self.source or m.candidate.name in told:
                continue
            told.add(m.candidate.name)
            label = m.candidate.drafter_label
            params = catalog.params_of(m.candidate.config, label, context.deployment, context.base, context.space)
            if params is not None:
                study.add_trial(optuna.trial.create_trial(params=params, value=m.objective,
                                                          distributions=catalog.distributions(context.space, label)))


# ---- the stage ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExploreResult:
    direction: DirectionName
    baseline: Measurement  # the build; objective = geomean of its speedup vs AR over the bench runs
    measured: tuple[Measurement, ...]  # memory candidates first, then search trials, in order
    selected: tuple[Measurement, ...]  # beat the build in their own bench run without differing from AR
    memory_first: tuple[str, ...]  # the memory candidates, measured before any search trial
    space: catalog.SearchSpace
    requests: tuple[dict[str, Any], ...]  # every quick-bench request


def explore(session: DeploymentSession, base: Candidate, direction: Direction, prompts: list[TokenizedPrompt],
            params: ExploreParams, memory_hits: tuple[MemoryHit, ...] = (), attribution: Attribution | None = None,
            proposers: tuple[Proposer, ...] = (MemoryProposer(), SearchProposer())) -> ExploreResult:
    """Memory's candidates first (decoded in the first batch), then the search; selects who beat the build."""
    space = catalog.search_space(session.deployment, base, direction.name, min_settings=2 * params.trials)
    bench = QuickBench(session, prompts, params.max_new_tokens, base, params.repeats)
    ctx = ExploreContext(session.deployment, base, attribution, space, tuple(memory_hits), bench, params)
    first = [c for pr in proposers if pr.source is CandidateSource.MEMORY
             for c in pr.propose(direction, ctx, params.memory_candidates)]
    bench.enqueue(first)
    for pr in proposers:
        if pr.source is not CandidateSource.MEMORY:
            pr.propose(direction, ctx, params.keep)
    bench.flush()
    if not bench.baselines:  # nothing to try at all: still measure the build
        bench([])
    selected: dict[tuple[str, str | None], Measurement] = {}
    for m in sorted(bench.log, key=lambda m: -m.objective / max(m.baseline, 1e-9)):
        key = (m.candidate.config.digest(), m.candidate.drafter_label)
        if m.beats_baseline and key not in selected and len(selected) < params.keep:
            selected[key] = m
    baseline = dataclasses.replace(bench.baselines[0], objective=_geomean([b.objective for b in bench.baselines]))
    return ExploreResult(direction.name, baseline, tuple(bench.log), tuple(selected.values()),
                         tuple(c.name for c in first), space, tuple(bench.rows))


def _geomean(values: list[float]) -> float:
    positive = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in positive) / len(positive)) if positive else 0.0


def write_explore(result: ExploreResult, out_dir: Path) -> None:
    (out_dir / "candidates.json").write_text(json.dumps({
        "direction": result.direction.value, "baseline": result.baseline.to_dict(),
        "memory_first": list(result.memory_first),
        "selected": [m.to_dict() for m in result.selected]}, indent=1))
    (out_dir / "measurements.json").write_text(json.dumps([m.to_dict() for m in result.measured], indent=1))
    (out_dir / "search_space.json").write_text(json.dumps(result.space.to_dict(), indent=1))
    pq.write_table(pa.Table.from_pylist(list(result.requests)), out_dir / "measurements.parquet")


def run(run: StageRun) -> dict[str, Any]:
    params = ExploreParams.from_dict(run.request.params)
    base = Candidate.from_dict(run.read_json("profile", "build.json"))
    attribution = Attribution.from_dict(run.read_json("attribute", "attribution.json"))
    wanted = run.param("direction")
    direction = next(d for d in attribution.directions if wanted in (None, d.name.value))
    recalled = run.read_json("recall", "memory_hits.json") if run.roles("recall") else []
    hits = tuple(MemoryHit.from_dict(h) for h in recalled)
    prompts = run.prompts(SplitName.TUNE, params.prompts)
    with exclusive(run.device):
        result = explore(run.session(), base, direction, prompts, params, hits, attribution)
    write_explore(result, run.out_dir)
    return {"direction": result.direction.value, "baseline": result.baseline.objective, "tried": len(result.measured),
            "memory_first": list(result.memory_first), "widened": result.space.widened,
            "selected": [m.to_dict() for m in result.selected],
            "lossy": [m.to_dict() for m in result.measured if not m.matches_ar]}
