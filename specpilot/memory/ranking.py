"""Retrieval: rank mechanisms for a deployment by how similar the scopes they were proven on are to it.

A scope's similarity is the weighted sum of its fields that equal the query's. The default weights are
powers of two, so a more important match always outweighs every less important one together
(same model > same model family > same GPU > same drafter > same regime). A mechanism scores the best
similarity among its passing evidence; ties go to the best measured gain at that similarity.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterable

from specpilot.memory.records import Mechanism, RankedMechanism, Scope

SCOPE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Scope))


@dataclass(frozen=True)
class ScopeWeights:
    """Weight of each matching Scope field; must follow model > model_family > gpu > drafter > regime > 0."""
    model: int = 16
    model_family: int = 8
    gpu: int = 4
    drafter: int = 2
    regime: int = 1

    def __post_init__(self) -> None:
        order = (self.model, self.model_family, self.gpu, self.drafter, self.regime)
        if not all(isinstance(w, int) and not isinstance(w, bool) for w in order):
            raise ValueError(f"scope weights must be integers, got {order}")
        if not (order[0] > order[1] > order[2] > order[3] > order[4] > 0):
            raise ValueError(f"scope weights must satisfy model > model_family > gpu > drafter > regime > 0, "
                             f"got {order}")

    def similarity(self, query: Scope, proven: Scope) -> tuple[int, tuple[str, ...]]:
        matched = tuple(name for name in SCOPE_FIELDS if getattr(query, name) == getattr(proven, name))
        return sum(getattr(self, name) for name in matched), matched


@dataclass(frozen=True)
class PassingEvidence:
    """The part of a passing evidence row that ranking needs."""
    mechanism_id: int
    mechanism: Mechanism
    scope: Scope
    gain: float
    run_id: str


def rank_mechanisms(rows: Iterable[PassingEvidence], query: Scope, weights: ScopeWeights = ScopeWeights(),
                    limit: int | None = None) -> list[RankedMechanism]:
    """Best first: by similarity of the best-matching scope, then gain there, then name (for determinism)."""
    best: dict[int, RankedMechanism] = {}
    counts: dict[int, int] = {}
    for row in rows:
        counts[row.mechanism_id] = counts.get(row.mechanism_id, 0) + 1
        score, matched = weights.similarity(query, row.scope)
        current = best.get(row.mechanism_id)
        if current is None or (score, row.gain) > (current.score, current.best_gain):
            best[row.mechanism_id] = RankedMechanism(
                mechanism_id=row.mechanism_id, mechanism=row.mechanism, score=score, matched=matched,
                best_gain=row.gain, proven_on=row.scope, proven_in_run=row.run_id, passing_evidence=0)
    ranked = sorted(
        (replace(r, passing_evidence=counts[mid]) for mid, r in best.items()),
        key=lambda r: (-r.score, -r.best_gain, r.mechanism.name))
    return ranked if limit is None else ranked[:limit]
