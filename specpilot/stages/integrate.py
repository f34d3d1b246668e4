"""Validate (token forcing of one candidate, as a stage) and integrate: combine what passed, re-benchmark the
result against stock on the held-out prompts, emit the new build content-addressed, and write memory.

Integration applies the accepted candidates' config deltas together where they agree (a field set to two
values, or two drafters, cannot be combined), checks the combination still beats the best single candidate
by decoding it again and proves it lossless by token forcing. The final build is whichever of stock, the
current build and that result is fastest on the held-out prompts, so it is never slower than stock there, except
that the new result must lead credibly: its paired bootstrap interval over the runner-up lies above 1 (a lead
within the noise of a few requests keeps the runner-up); when nothing beats stock the final build is stock and
the decision says so. Agent code is validated in the
sandbox (agents/forcing.py) and, passing, recorded but not built in. Memory is written only here
(stages/remember.py), including whether memory's candidates carried over to this scope.

A batch-regime deployment's builds carry a BatchConfig: validation checks every request the candidate serves
batched against its single-request AR output (stages/batch_validate.py), combination merges BatchConfig deltas
too, builds are compared batched at the deployment's concurrencies (stages/heldout.py), and the build stores
its batch_config.json next to its engine_config.json (stages/io.py).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from specpilot.agents.forcing import validate_isolated, write_sandboxed_verdict
from specpilot.bench.harness import CI_LEVEL
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.deployments import Deployment
from specpilot.engines.config import ConfigError, DType
from specpilot.memory import Failure, Memory, RunStatus
from specpilot.stages import batch_catalog, catalog
from specpilot.stages.batch_validate import validate_batched, write_batch_verdict
from specpilot.stages.candidate import Candidate, CandidateSource
from specpilot.stages.heldout import Heldout, heldout_batched, heldout_single
from specpilot.stages.devices import exclusive
from specpilot.stages.io import SplitName, StageRun, write_build
from specpilot.stages.remember import Explored, record_memory
from specpilot.stages.validate import VerdictKind, validate, write_verdict
from specpilot.stats import geomean

# Logit margins below about one rounding step of the dtype at typical logit sizes (|logit| 8..16) are ties.
TIE_EPSILON = {DType.BF16: 2.0 ** -4, DType.FP16: 2.0 ** -7, DType.FP32: 1e-5}
HELDOUT_LABELS = ("stock", "current", "candidate")  # preference order on equal speed: the simpler build wins


def tie_epsilon(dep: Deployment, given: float | None = None) -> float:
    return TIE_EPSILON[dep.engine.dtype] if given is None else float(given)


def _per_benchmark(pairs: list[tuple[str, float]]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for key, value in pairs:
        groups.setdefault(key.split("/", 1)[0], []).append(value)
    return {b: geomean(v) for b, v in groups.items()}


@dataclass(frozen=True)
class ValidateParams:
    prompts: int = 0  # held-out prompts (0: all of the validate split)
    max_new_tokens: int = 0  # 0: the workload's
    tie_epsilon: float | None = None  # None: TIE_EPSILON of the deployment's dtype

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ValidateParams":
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})


def run_validate(run: StageRun) -> dict[str, Any]:
    """Token forcing of params.candidate against params.stock on held-out prompts."""
    dep, params = run.deployment, ValidateParams.from_dict(run.request.params)
    stock, candidate = Candidate.from_dict(run.param("stock")), Candidate.from_dict(run.param("candidate"))
    prompts = run.prompts(SplitName.VALIDATE, params.prompts)
    max_new = params.max_new_tokens or dep.workload.max_new_tokens
    eps = tie_epsilon(dep, params.tie_epsilon)
    with exclusive(run.device):
        if dep.batched:  # served batched: every request against its single-request AR output
            checked = validate_batched(run.session(), stock, candidate, prompts, max_new, eps)
            write_batch_verdict(checked, run.out_dir)
            kind, reasons, speedups = checked.kind, checked.reasons, checked.speedup
            per_benchmark = checked.per_benchmark()
        elif candidate.runs_isolated:  # agent code: the candidate's half of token forcing runs in the sandbox
            sandboxed = validate_isolated(run.session(), stock, candidate, prompts, max_new, eps, run.scratch)
            write_sandboxed_verdict(sandboxed, run.out_dir)
            kind, reasons = sandboxed.kind, sandboxed.reasons
            speedups = None if sandboxed.verdict is None else sandboxed.verdict.speedup
            per_benchmark = {} if sandboxed.verdict is None else _per_benchmark(
                [(p.prompt, p.speedup) for p in sandboxed.verdict.prompts])
        else:
            verdict = validate(run.session(), stock, candidate, prompts, max_new, eps)
            write_verdict(verdict, run.out_dir)
            kind, reasons, speedups = verdict.kind, verdict.reasons, verdict.speedup
            per_benchmark = _per_benchmark([(p.prompt, p.speedup) for p in verdict.prompts])
    (run.out_dir / "candidate.json").write_text(json.dumps(candidate.to_dict(), indent=1))
    # A candidate stopped before any verdict (the sandbox, or a build the batched engine cannot serve) has no
    # speed to report: 0, never accepted.
    speedup = 0.0 if speedups is None or not speedups.first else min(
        speedups.geomean, speedups.remeasured_geomean or speedups.geomean)
    return {"candidate": candidate.to_dict(), "verdict": kind.value, "speedup_vs_stock": speedup,
            "per_benchmark": per_benchmark, "reasons": list(reasons), "prompts": len(prompts),
            "max_new_tokens": max_new, "sandboxed": candidate.runs_isolated and not dep.batched,
            "regime": dep.regime.label}


@dataclass(frozen=True)
class ValidatedCandidate:
    candidate: Candidate
    verdict: VerdictKind
    speedup_vs_stock: float  # held-out, from the validation run
    per_benchmark: dict[str, float]
    reasons: tuple[str, ...]
    evidence_uri: str  # the validation stage's manifest

    @property
    def accepted(self) -> bool:
        return self.verdict is VerdictKind.PASS and self.speedup_vs_stock > 1.0

    @property
    def rejection(self) -> str:
        if self.verdict is not VerdictKind.PASS:
            return f"token forcing {self.verdict.value}: " + "; ".join(self.reasons[:3])
        return f"lossless but {self.speedup_vs_stock:.3f}x vs stock on held-out prompts (not faster)"

    @classmethod
    def from_summary(cls, summary: dict[str, Any], uri: str) -> "ValidatedCandidate":
        return cls(Candidate.from_dict(summary["candidate"]), VerdictKind(summary["verdict"]), summary["speedup_vs_stock"],
                   summary["per_benchmark"], tuple(summary["reasons"]), uri)


@dataclass(frozen=True)
class IntegrateParams:
    round: int = 1
    final_round: bool = True
    heldout_prompts: int = 0  # validate-split prompts for the final comparison (0: all)
    heldout_max_new_tokens: int = 0  # 0: the workload's
    recheck_prompts: int = 2  # tune prompts for the combination-still-wins check
    recheck_max_new_tokens: int = 16
    tie_epsilon: float | None = None
    memory: str | None = None  # memory file (default: $SPECPILOT_MEMORY or the cache)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "IntegrateParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class IntegrateResult:
    final: Candidate
    final_label: str  # which of HELDOUT_LABELS won
    combined_from: tuple[str, ...]  # accepted candidates the integrated candidate applies
    candidate: Candidate | None  # the integrated candidate measured on held-out prompts (None: nothing accepted)
    decisions: tuple[str, ...]
    heldout: Heldout
    final_vs_stock: float  # held-out: geomean of stock decode time / final decode time (batch regime: throughputs)
    speedup_vs_ar: dict[str, float]  # label -> held-out geomean speedup vs AR

    @property
    def final_is_stock(self) -> bool:
        return self.final_label == "stock"

    @property
    def final_vs_stock_interval(self) -> tuple[float, float] | None:
        """final_vs_stock's paired bootstrap interval (None when the final build is stock or one unit was run)."""
        return None if self.final_is_stock else self.heldout.ratio_interval(self.final_label, "stock")

    def summary(self) -> dict[str, Any]:
        return {"final": self.final.to_dict(), "final_label": self.final_label, "final_is_stock": self.final_is_stock,
                "combined_from": list(self.combined_from), "decisions": list(self.decisions),
                "final_vs_stock": self.final_vs_stock, "final_vs_stock_interval": self.final_vs_stock_interval,
                "final_vs_ar": self.speedup_vs_ar[self.final_label],
                "stock_vs_ar": self.speedup_vs_ar["stock"], "speedup_vs_ar": self.speedup_vs_ar,
                "heldout_prompts": self.heldout.prompts, "heldout_max_new_tokens": self.heldout.max_new_tokens,
                "final_batch_config": None if self.final.batch_config is None else self.final.batch_config.to_dict()}


def combine(dep: Deployment, current: Candidate, accepted: list[ValidatedCandidate],
            round_: int) -> tuple[Candidate, tuple[ValidatedCandidate, ...], tuple[str, ...]]:
    """The accepted deltas (relative to the current build) applied together, best first; returns the candidate,
    the accepted candidates it applies and a note for each one left out because it conflicts."""
    ranked = sorted(accepted, key=lambda v: -v.speedup_vs_stock)
    # One flat namespace (BatchConfig fields as batch.<field>) so a batching knob set two ways is a conflict too.
    deltas = [{**batch_catalog.flat({**catalog.config_delta(current.config, v.candidate.config),
                                     batch_catalog.BATCH_DELTA: batch_catalog.batch_delta(current.batch_config,
                                                                                          v.candidate.batch_config)}),
               catalog.DRAFTER_PARAM: v.candidate.drafter_label} for v in ranked]
    merged, used = catalog.merge_deltas(deltas)
    notes = tuple(f"{v.candidate.name} left out: sets {sorted(k for k in deltas[i] if merged.get(k) != deltas[i][k])} "
                  f"differently from {ranked[0].candidate.name}" for i, v in enumerate(ranked) if i not in used)
    label = merged.pop(catalog.DRAFTER_PARAM)
    if len(used) > 1:
        try:
            engine_delta, batch_delta = batch_catalog.split_delta(batch_catalog.nested(merged))
            config, label = catalog.apply_delta(dep, current, engine_delta, label)
            batch = batch_catalog.apply_batch_delta(dep, current.batch_config, batch_delta)
        except (ConfigError, ValueError) as e:
            return ranked[0].candidate, (ranked[0],), notes + (f"combination not buildable ({e})",)
        parts = tuple(ranked[i] for i in used)
        mechanisms = tuple(dict.fromkeys(m for v in parts for m in v.candidate.mechanisms))
        return Candidate(f"integrated-r{round_}", config, mechanisms=mechanisms, source=CandidateSource.INTEGRATED,
                         drafter_label=label, batch_config=batch), parts, notes
    return ranked[0].candidate, (ranked[0],), notes


def _prove_combination(session: DeploymentSession, stock: Candidate, best: Candidate, combined: Candidate,
                       tune_prompts: list[TokenizedPrompt], heldout_prompts: list[TokenizedPrompt],
                       params: IntegrateParams, out_dir: Path) -> str:
    """'' when the combination still beats the best single candidate (decoded again on tune prompts) and passes
    token forcing against stock (batch regime: serves every held-out request equal to its single-request AR
    output); otherwise why it does not."""
    dep = session.deployment
    compare = heldout_batched if dep.batched else heldout_single
    check = compare(session, {"best": best, "combined": combined}, tune_prompts, params.recheck_max_new_tokens)
    wins = check.matches_ar["combined"] and check.speedup_vs_ar["combined"] >= check.speedup_vs_ar["best"]
    max_new, eps = params.heldout_max_new_tokens or dep.workload.max_new_tokens, tie_epsilon(dep, params.tie_epsilon)
    verdict = None if not wins else (validate_batched if dep.batched else validate)(
        session, stock, combined, heldout_prompts, max_new, eps)
    (out_dir / "combination.json").write_text(json.dumps({"recheck": check.report, "verdict": (
        verdict.to_dict() if verdict else None)}, indent=1))
    if verdict is None:
        return "slower than the best single candidate when decoded again"
    return "" if verdict.kind is VerdictKind.PASS else f"token forcing {verdict.kind.value}"


def integrate(session: DeploymentSession, stock: Candidate, current: Candidate, validated: list[ValidatedCandidate],
              tune_prompts: list[TokenizedPrompt], heldout_prompts: list[TokenizedPrompt], params: IntegrateParams,
              out_dir: Path) -> IntegrateResult:
    dep = session.deployment
    decisions = [f"{v.candidate.name}: rejected, {v.rejection}" for v in validated if not v.accepted]
    # Agent code passed token forcing in the sandbox, but a build is decoded in-process (profile, bench, serving):
    # it is not built in automatically. Memory records it, with its code reference, for a person to review.
    decisions += [f"{v.candidate.name}: passed token forcing in the sandbox ({v.speedup_vs_stock:.3f}x vs stock); "
                  "agent code is not built into the engine without review" for v in validated
                  if v.accepted and v.candidate.runs_isolated]
    accepted = [v for v in validated if v.accepted and not v.candidate.runs_isolated]
    candidate, parts, notes = (None, (), ()) if not accepted else combine(dep, current, accepted, params.round)
    decisions += list(notes)
    if candidate is not None and len(parts) == 1:
        decisions.append(f"candidate for the held-out comparison: {candidate.name} "
                         f"({parts[0].speedup_vs_stock:.3f}x vs stock in validation)")
    if candidate is not None and len(parts) > 1:
        failure = _prove_combination(session, stock, parts[0].candidate, candidate, tune_prompts, heldout_prompts,
                                     params, out_dir)
        names = [p.candidate.name for p in parts]
        if failure:
            decisions.append(f"combination of {names} dropped: {failure}; keeping {parts[0].candidate.name}")
            candidate, parts = parts[0].candidate, parts[:1]
        else:
            decisions.append(f"combined {names} into {candidate.name}")
    builds = {"stock": stock}
    if (current.build_digest, current.drafter_label) != (stock.build_digest, stock.drafter_label):
        builds["current"] = current
    if candidate is not None:
        builds["candidate"] = candidate
    max_new = params.heldout_max_new_tokens or dep.workload.max_new_tokens
    # The batch regime compares builds as they serve: batched, at the deployment's concurrencies.
    held = (heldout_batched if dep.batched else heldout_single)(session, builds, heldout_prompts, max_new)
    speedups = held.speedup_vs_ar
    eligible = [label for label in HELDOUT_LABELS if label in builds and (label == "stock" or held.matches_ar[label])]
    final_label = _fastest(eligible, speedups)
    if final_label == "candidate":
        final_label = _credibly_faster(held, eligible, speedups, decisions)
    decisions.append(f"held-out ({len(heldout_prompts)} prompts, {max_new} new tokens"
                     + (f", batched at concurrency {list(dep.regime.concurrency)}" if dep.batched else "") + "): "
                     + ", ".join(f"{label} {speedups[label]:.3f}x vs AR" for label in builds)
                     + f"; final build = {final_label}"
                     + (" (no candidate beat stock: the final build IS stock)" if final_label == "stock" else ""))
    return IntegrateResult(builds[final_label], final_label, tuple(p.candidate.name for p in parts), candidate,
                           tuple(decisions), held, held.final_vs_stock[final_label], speedups)


def _fastest(labels: list[str], speedups: dict[str, float]) -> str:
    """The fastest build of labels on the held-out prompts; on equal speed the simpler (HELDOUT_LABELS order)."""
    return max(labels, key=lambda label: (speedups[label], -HELDOUT_LABELS.index(label)))


def _credibly_faster(held: Heldout, eligible: list[str], speedups: dict[str, float], decisions: list[str]) -> str:
    """The candidate leads the held-out comparison: it becomes the final build only if its paired interval over the
    runner-up (the faster of stock and the current build) lies above 1. A lead inside the noise of a few requests
    would swap builds on chance and record a mechanism that proved nothing. One shared unit: the lead decides."""
    runner_up = _fastest([label for label in eligible if label != "candidate"], speedups)
    interval = held.ratio_interval("candidate", runner_up)
    if interval is None or interval[0] > 1.0:
        return "candidate"
    decisions.append(f"candidate {speedups['candidate']:.3f}x vs AR leads {runner_up} ({speedups[runner_up]:.3f}x), "
                     f"but its paired {CI_LEVEL:.0%} interval over {runner_up} is "
                     f"{interval[0]:.3f}-{interval[1]:.3f}x: "
                     f"not credibly faster, {runner_up} stays")
    return runner_up


def mark_run_failed(memory_path: str | None, run_id: str, reason: str) -> None:
    """Close a run that stopped before its last integration (the flow calls this on failure)."""
    with Memory.open(memory_path) as memory, memory.transaction():
        if memory.sql("SELECT count(*) FROM runs WHERE run_id = ?", params=[run_id]).rows[0][0]:
            memory.record_failure(Failure(run_id, "tune", reason))
            memory.finish_run(run_id, RunStatus.FAILED)


def run(run: StageRun) -> dict[str, Any]:
    params = IntegrateParams.from_dict(run.request.params)
    stock, current = Candidate.from_dict(run.param("stock")), Candidate.from_dict(run.param("current"))
    validated = [ValidatedCandidate.from_summary(run.manifest(role).meta["summary"], run.request.inputs[role])
                 for role in run.roles("validate")]
    explored = Explored.from_manifests([run.manifest(role) for role in run.roles("explore")])
    tune_prompts = run.prompts(SplitName.TUNE, params.recheck_prompts)
    heldout_prompts = run.prompts(SplitName.VALIDATE, params.heldout_prompts)
    with exclusive(run.device):
        result = integrate(run.session(), stock, current, validated, tune_prompts, heldout_prompts, params, run.out_dir)
    (run.out_dir / "heldout.json").write_text(json.dumps(result.heldout.report, indent=1))
    build = write_build(run, result.final)
    heldout_uri = run.store.uri_for(f"{run.request.prefix}/heldout.json")
    rows = record_memory(run, stock, validated, explored, result, params, heldout_uri)
    summary = {**result.summary(), "build": asdict(build), "memory": rows, "round": params.round}
    (run.out_dir / "integration.json").write_text(json.dumps(summary, indent=1))
    return summary
