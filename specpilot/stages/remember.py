"""What integrate (memory's one writer) records, in one transaction per integration.

- the run (dated from its run id), once;
- per accepted candidate: its mechanism, the scope it was proven on and one evidence row per benchmark;
- a failure row per rejected, lossy or sandbox-stopped candidate, so it is not retried blindly;
- per memory candidate (a mechanism proven elsewhere, tried first here): whether it carried over to this
  scope (memory/transfer.py). Token-forced ones get a transfer evidence row (verdict, held-out speedup over
  stock before = 1.0 and after); one that never reached validation gets a `transfer` failure row saying
  what the quick bench saw. Evidence of a carried-over mechanism stays under the mechanism's own name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specpilot.agents.plan import policy_file
from specpilot.artifacts.manifest import Manifest, run_started
from specpilot.memory import Evidence, Failure, Mechanism, MechanismCategory, Memory, RunStatus, Scope, Verdict
from specpilot.memory.transfer import TRANSFER_STAGE, record_transfer
from specpilot.stages import catalog
from specpilot.stages.batch_catalog import BATCH_DELTA, batch_delta, flat
from specpilot.stages.candidate import Candidate
from specpilot.stages.io import StageRun, memory_scope
from specpilot.stages.proposers import MemoryHit
from specpilot.stages.quickbench import TrialStatus

if TYPE_CHECKING:
    from specpilot.stages.integrate import IntegrateParams, IntegrateResult, ValidatedCandidate


def memory_delta(stock: Candidate, candidate: Candidate) -> dict[str, Any]:
    """What memory stores for a candidate: its fields that differ from stock, and always its drafter kind (a draft
    length means something else for another drafter), so another deployment applies it to that drafter. A batch
    regime build's BatchConfig fields that differ from stock nest under "batch" (batch_catalog.BATCH_DELTA): only
    batch-regime deployments apply those."""
    batch = batch_delta(stock.batch_config, candidate.batch_config)
    return {**catalog.config_delta(stock.config, candidate.config), "drafter": candidate.config.drafter.value,
            **({BATCH_DELTA: batch} if batch else {})}


def mechanism_name(candidate: Candidate, delta: dict[str, Any]) -> str:
    """A validated mechanism: the catalog mechanisms it turns and the exact delta over stock it was proven with
    (BatchConfig fields as batch.<field>)."""
    named = ",".join(f"{k}={v}" for k, v in sorted(flat(delta).items()))
    return "+".join(candidate.mechanisms or ("config",)) + ":" + named


@dataclass(frozen=True)
class TransferTrial:
    """One of memory's candidates as explore measured it (explore's summary, "transfers")."""

    candidate: str
    status: TrialStatus
    objective: float  # quick-bench speedup vs AR (0 if lossy or not run)
    baseline: float  # the build's, in the same bench run
    error: str
    hit: MemoryHit  # the mechanism and where it was proven

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TransferTrial":
        return cls(d["candidate"], TrialStatus(d["status"]), float(d["objective"]), float(d["baseline"]), d["error"],
                   MemoryHit.from_dict(d["hit"]))


@dataclass(frozen=True)
class Explored:
    """What integrate reads from the round's explore stages."""

    lossy: tuple[dict[str, Any], ...]  # measurements that differed from AR, did not run, or were stopped
    transfers: tuple[TransferTrial, ...]
    code_uris: dict[str, str]  # published output name -> store URI (agent candidates' policy code)

    @classmethod
    def from_manifests(cls, manifests: list[Manifest]) -> "Explored":
        summaries = [m.meta["summary"] for m in manifests]
        return cls(tuple(m for s in summaries for m in s["lossy"]),
                   tuple(TransferTrial.from_dict(t) for s in summaries for t in s.get("transfers", ())),
                   {o.name: o.uri for m in manifests for o in m.outputs if o.name.startswith("policy-")})

    def code_ref(self, candidate: Candidate) -> str | None:
        """Where memory points for a candidate's code: agent code as explore stored it (the sandbox's copy is
        scratch), our own policies by module path."""
        if not candidate.runs_isolated or (uri := self.code_uris.get(policy_file(candidate.name))) is None:
            return candidate.policy
        return f"{uri}:{candidate.policy.rsplit(':', 1)[1]}"


def _known(memory: Memory, name: str) -> bool:
    return bool(memory.sql("SELECT count(*) FROM mechanisms WHERE name = ?", params=[name]).rows[0][0])


def _ensure_mechanism(memory: Memory, hit: MemoryHit) -> None:
    """A recalled mechanism is normally in this memory already; keep its original record (delta, description)."""
    if not _known(memory, hit.name):
        memory.record_mechanism(Mechanism(hit.name, MechanismCategory(hit.category), hit.description,
                                          hit.config_delta, hit.code_ref))


def _record_transfer(memory: Memory, run: StageRun, t: TransferTrial,
                     v: "ValidatedCandidate | None") -> tuple[int, int]:
    """Evidence of whether `t` carried over (and a failure row when it did not), or only a failure row when it
    was never token-forced here; returns (evidence rows, failure rows) written."""
    dep, run_id = run.deployment, run.request.run_id
    source = Scope(**t.hit.proven_on)
    if v is None or v.speedup_vs_stock <= 0:
        seen = t.error or f"{t.objective:.3f}x vs AR, the build {t.baseline:.3f}x"
        memory.record_failure(Failure(run_id, TRANSFER_STAGE, f"{t.candidate}: tried first from {source.model} "
                                      f"({source.gpu}), not token-forced here: quick bench {t.status.value} ({seen})",
                                      mechanism=t.hit.name))
        return 0, 1
    _ensure_mechanism(memory, t.hit)
    outcome = record_transfer(memory, t.hit.name, source, memory_scope(dep, v.candidate.drafter_label, run.device),
                              Verdict(v.verdict.value), 1.0, v.speedup_vs_stock, run_id=run_id, deployment=dep.name,
                              metric="speedup_vs_stock", artifact_uris=(v.evidence_uri,))
    return 1, int(not outcome.carried_over)


def record_memory(run: StageRun, stock: Candidate, validated: list["ValidatedCandidate"], explored: Explored,
                  result: "IntegrateResult", params: "IntegrateParams", heldout_uri: str) -> dict[str, int]:
    """Run, mechanisms, scopes and evidence for accepted candidates, failures for rejected ones, and transfers."""
    dep, run_id = run.deployment, run.request.run_id
    counts = {"mechanisms": 0, "evidence": 0, "failures": 0, "transfers": 0}
    stock_bench = {b: result.heldout.geomean("stock", b) for b in result.heldout.benchmarks()}
    measured = {b: result.heldout.geomean("candidate", b) for b in result.heldout.benchmarks()}
    on_heldout = set(result.combined_from)  # measured against stock on the held-out prompts, won or not
    from_memory = {t.candidate: t for t in explored.transfers}
    with Memory.open(params.memory) as memory, memory.transaction():
        if not memory.sql("SELECT count(*) FROM runs WHERE run_id = ?", params=[run_id]).rows[0][0]:
            # Recorded here (memory's one writer), dated from the run id: when the run began, not when it ends.
            memory.record_run(run_id, dep.name, {**dep.fingerprint(), "digest": dep.fingerprint_digest()},
                              started=run_started(run_id))
        for v in validated:
            delta = memory_delta(stock, v.candidate)
            if not v.accepted or (len(delta) == 1 and v.candidate.policy is None):  # nothing over stock
                memory.record_failure(Failure(run_id, "validate", f"{v.candidate.name}: {v.rejection}", config_delta=delta))
                counts["failures"] += 1
                continue
            scope = memory_scope(dep, v.candidate.drafter_label, run.device)
            if (t := from_memory.get(v.candidate.name)) is not None:  # the same mechanism, proven on one more scope
                name = t.hit.name
                _ensure_mechanism(memory, t.hit)
            else:
                name = mechanism_name(v.candidate, delta)
                described = ", ".join(catalog.BY_NAME[m].description for m in v.candidate.mechanisms
                                      if m in catalog.BY_NAME)
                memory.record_mechanism(Mechanism(name, catalog.mechanism_category(v.candidate.mechanisms),
                                                  described or name, delta, explored.code_ref(v.candidate)))
                counts["mechanisms"] += 1
            rows = [(b, "speedup_vs_stock", 1.0, s, v.evidence_uri) for b, s in v.per_benchmark.items()]
            if v.candidate.name in on_heldout:
                rows += [(b, "speedup_vs_ar", stock_bench[b], measured[b], heldout_uri) for b in measured
                         if stock_bench[b] and measured[b]]
            for bench, metric, before, after, uri in rows:
                memory.record_evidence(Evidence(name, scope, run_id, dep.name, bench, metric, before, after,
                                                Verdict(v.verdict.value), artifact_uris=(uri,)))
                counts["evidence"] += 1
        for m in explored.lossy:
            delta = memory_delta(stock, Candidate.from_dict(m["candidate"]))
            memory.record_failure(Failure(run_id, "explore", f"{m['candidate']['name']}: {m['error']}", config_delta=delta))
            counts["failures"] += 1
        by_name = {v.candidate.name: v for v in validated}
        for t in explored.transfers:
            evidence, failures = _record_transfer(memory, run, t, by_name.get(t.candidate))
            counts["evidence"] += evidence
            counts["failures"] += failures
            counts["transfers"] += 1
        if params.final_round:
            report_uri = run.store.uri_for(f"{run.request.prefix}/manifest.json")
            memory.finish_run(run_id, RunStatus.SUCCEEDED, report_uri=report_uri)
    return counts
