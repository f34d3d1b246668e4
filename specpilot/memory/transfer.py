"""Memory transfer: mechanisms proven on one deployment are tried first on another with a similar scope, and
an evidence row on the new scope says whether each carried over.

The explore stage's memory proposer tries the recalled mechanisms first; validation token-forces them on the
new deployment's held-out prompts; integrate (memory's one writer) calls `record_transfer` with that verdict
and the held-out speedup over stock before (1.0) and after. A transfer is ordinary evidence on the destination
scope (so retrieval sees it), with the source scope in its artifact URIs as
`transfer://family/model/drafter/gpu/regime?carried=0|1` (the schema has no column for it). A mechanism that
did not carry over (lossy there, or no faster) also gets a `failures` row, and neither `transfer_candidates`
nor explore's recall offers it to that scope again.

From the command line (read-only), every transfer with its outcome:

    specpilot memory sql "SELECT m.name AS mechanism,
        regexp_extract(e.artifact_uris::VARCHAR, 'transfer://[^/]*/([^/]*)/', 1) AS proven_on_model,
        s.model AS tried_on_model, e.run_id, e.verdict, e.before, e.after,
        regexp_extract(e.artifact_uris::VARCHAR, 'carried=([01])', 1) = '1' AS carried_over
      FROM evidence e JOIN mechanisms m ON m.id = e.mechanism_id JOIN scopes s ON s.id = e.scope_id
      WHERE e.artifact_uris::VARCHAR LIKE '%transfer://%' ORDER BY e.id"

(`TRANSFER_SQL` below is that query; the source model is URL-quoted as in the URI.)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from urllib.parse import parse_qs, quote, unquote, urlsplit

from specpilot.memory import Failure, Memory, RankedMechanism, Scope, Verdict
from specpilot.memory.records import Evidence

TRANSFER_SCHEME = "transfer"
TRANSFER_STAGE = "transfer"
TRANSFER_SQL = """SELECT m.name AS mechanism,
    regexp_extract(e.artifact_uris::VARCHAR, 'transfer://[^/]*/([^/]*)/', 1) AS proven_on_model,
    s.model AS tried_on_model, e.run_id, e.verdict, e.before, e.after,
    regexp_extract(e.artifact_uris::VARCHAR, 'carried=([01])', 1) = '1' AS carried_over
  FROM evidence e JOIN mechanisms m ON m.id = e.mechanism_id JOIN scopes s ON s.id = e.scope_id
  WHERE e.artifact_uris::VARCHAR LIKE '%transfer://%' ORDER BY e.id"""


def transfer_uri(from_scope: Scope, carried: bool) -> str:
    path = "/".join(quote(getattr(from_scope, f.name), safe="") for f in fields(Scope))
    return f"{TRANSFER_SCHEME}://{path}?carried={int(carried)}"


def parse_transfer_uri(uri: str) -> tuple[Scope, bool] | None:
    parts = urlsplit(uri)
    if parts.scheme != TRANSFER_SCHEME:
        return None
    values = [unquote(parts.netloc)] + [unquote(p) for p in parts.path.lstrip("/").split("/")]
    if len(values) != len(fields(Scope)):
        return None
    return Scope(*values), parse_qs(parts.query).get("carried") == ["1"]


@dataclass(frozen=True)
class TransferOutcome:
    mechanism: str
    from_scope: Scope
    to_scope: Scope
    verdict: Verdict
    before: float
    after: float
    carried_over: bool  # lossless on the new scope (token forcing passed) and faster than before
    evidence_id: int

    @property
    def gain(self) -> float:
        return self.after / self.before


def record_transfer(memory: Memory, mechanism: str, from_scope: Scope, to_scope: Scope, verdict: Verdict,
                    before: float, after: float, *, run_id: str, deployment: str, benchmark: str = "all",
                    metric: str = "speedup", artifact_uris: tuple[str, ...] = ()) -> TransferOutcome:
    """Record the trial of `mechanism` (proven on `from_scope`) on `to_scope`; `before`/`after`: the metric
    (higher is better) without and with it, measured in run `run_id`."""
    carried = verdict is Verdict.PASS and after > before
    evidence = Evidence(mechanism, to_scope, run_id, deployment, benchmark, metric, before, after, verdict,
                        tuple(artifact_uris) + (transfer_uri(from_scope, carried),))
    evidence_id = memory.record_evidence(evidence)
    if not carried:
        why = f"token forcing {verdict.value}" if verdict is not Verdict.PASS else f"{metric} {before:g} -> {after:g}"
        memory.record_failure(Failure(run_id, TRANSFER_STAGE, f"did not carry over from {from_scope.model} "
                                      f"({from_scope.gpu}, {from_scope.drafter}): {why}", mechanism=mechanism))
    return TransferOutcome(mechanism, from_scope, to_scope, verdict, before, after, carried, evidence_id)


def transfer_history(memory: Memory, to_scope: Scope | None = None) -> list[TransferOutcome]:
    """Every recorded transfer (to `to_scope` only, if given), oldest first."""
    rows = memory.connection.execute("""
        SELECT e.id, m.name, s.model_family, s.model, s.drafter, s.gpu, s.regime, e.verdict, e.before, e.after,
               e.artifact_uris
        FROM evidence e JOIN mechanisms m ON m.id = e.mechanism_id JOIN scopes s ON s.id = e.scope_id
        WHERE e.artifact_uris::VARCHAR LIKE '%' || ? || '://%' ORDER BY e.id""", [TRANSFER_SCHEME]).fetchall()
    out = []
    for eid, name, *scope, verdict, before, after, uris in rows:
        dest = Scope(*scope)
        parsed = next((p for u in json.loads(uris) if (p := parse_transfer_uri(u)) is not None), None)
        if parsed is None or (to_scope is not None and dest != to_scope):
            continue
        out.append(TransferOutcome(name, parsed[0], dest, Verdict(verdict), before, after, parsed[1], int(eid)))
    return out


def failed_transfers(memory: Memory, to_scope: Scope) -> frozenset[str]:
    """Mechanisms whose latest transfer to `to_scope` did not carry over: not offered to that scope again."""
    latest = {t.mechanism: t.carried_over for t in transfer_history(memory, to_scope)}  # oldest first: last wins
    return frozenset(name for name, carried in latest.items() if not carried)


def transfer_candidates(memory: Memory, to_scope: Scope, limit: int = 10) -> list[RankedMechanism]:
    """Mechanisms proven on other scopes, most similar scope first (memory's ranking), without those already
    proven on `to_scope` itself and those whose transfer to it failed before."""
    failed = failed_transfers(memory, to_scope)
    ranked = memory.retrieve(to_scope, limit=max(limit * 4, 50))
    return [r for r in ranked if r.proven_on != to_scope and r.mechanism.name not in failed][:limit]
