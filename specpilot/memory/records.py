"""What the memory stores, as validated frozen dataclasses: mechanisms, the scopes they were proven on,
evidence rows (one measurement + token-forcing verdict), run bookkeeping and failures."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import Enum
from typing import Any


class MechanismCategory(Enum):
    ALGORITHM = "algorithm"  # drafting / tree shaping / verification policy
    KERNEL = "kernel"  # a kernel variant or tuning table
    SCHEDULING = "scheduling"  # batching and request scheduling


class Verdict(Enum):
    """Token forcing's verdict on a candidate: lossless, lossy, or a flip within the numerical-tie epsilon."""
    PASS = "pass"
    FAIL = "fail"
    TIE = "tie"


class RunStatus(Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


def _nonempty(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{owner}.{name} must be a non-empty string, got {value!r}")


def json_text(owner: str, value: Any) -> str:
    """Canonical JSON (sorted keys) so equal deltas compare equal as text; rejects what JSON cannot hold."""
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{owner} must be JSON-serialisable: {e}") from None


def _require_aware(owner: str, value: datetime | None) -> None:
    if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
        raise ValueError(f"{owner} must be a timezone-aware datetime, got {value!r}")


@dataclass(frozen=True)
class Scope:
    """Where something was proven. `regime` names the serving regime, e.g. "batch1" or "batch16"."""
    model_family: str
    model: str
    drafter: str
    gpu: str
    regime: str

    def __post_init__(self) -> None:
        for f in fields(self):
            _nonempty("Scope", f.name, getattr(self, f.name))


@dataclass(frozen=True)
class Mechanism:
    """A named, reusable change: a config delta over EngineConfig and/or code at an extension point."""
    name: str
    category: MechanismCategory
    description: str = ""
    config_delta: dict[str, Any] = field(default_factory=dict)
    code_ref: str | None = None

    def __post_init__(self) -> None:
        _nonempty("Mechanism", "name", self.name)
        if not isinstance(self.category, MechanismCategory):
            raise ValueError(f"Mechanism.category must be a MechanismCategory, got {self.category!r}")
        if not isinstance(self.config_delta, dict):
            raise ValueError(f"Mechanism.config_delta must be a dict, got {type(self.config_delta).__name__}")
        object.__setattr__(self, "config_delta", json.loads(json_text("Mechanism.config_delta", self.config_delta)))
        if self.code_ref is not None:
            _nonempty("Mechanism", "code_ref", self.code_ref)


@dataclass(frozen=True)
class Evidence:
    """One benchmark measurement of a mechanism on a scope, with its token-forcing verdict.

    Gain is after/before for higher-is-better metrics (tokens/s, speedup) and before/after otherwise
    (latency), so it is always "times better" and comparable across metrics.
    """
    mechanism: str  # name of a recorded mechanism
    scope: Scope
    run_id: str
    deployment: str
    benchmark: str
    metric: str
    before: float
    after: float
    verdict: Verdict
    artifact_uris: tuple[str, ...] = ()
    higher_is_better: bool = True
    created: datetime | None = None  # None: now

    def __post_init__(self) -> None:
        for name in ("mechanism", "run_id", "deployment", "benchmark", "metric"):
            _nonempty("Evidence", name, getattr(self, name))
        if not isinstance(self.scope, Scope):
            raise ValueError(f"Evidence.scope must be a Scope, got {self.scope!r}")
        if not isinstance(self.verdict, Verdict):
            raise ValueError(f"Evidence.verdict must be a Verdict, got {self.verdict!r}")
        for name in ("before", "after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise ValueError(f"Evidence.{name} must be a positive finite number, got {value!r}")
        object.__setattr__(self, "artifact_uris", tuple(self.artifact_uris))
        for uri in self.artifact_uris:
            _nonempty("Evidence", "artifact_uris[]", uri)
        _require_aware("Evidence.created", self.created)

    @property
    def gain(self) -> float:
        return self.after / self.before if self.higher_is_better else self.before / self.after


@dataclass(frozen=True)
class Failure:
    """Something that did not work, so it is not retried blindly: a mechanism (by name), an unnamed config
    delta, or (with neither) the stage itself."""
    run_id: str
    stage: str
    reason: str
    mechanism: str | None = None
    config_delta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("run_id", "stage", "reason"):
            _nonempty("Failure", name, getattr(self, name))
        if self.mechanism is not None:
            _nonempty("Failure", "mechanism", self.mechanism)
        if self.config_delta is not None:
            object.__setattr__(self, "config_delta", json.loads(json_text("Failure.config_delta", self.config_delta)))


@dataclass(frozen=True)
class RankedMechanism:
    """A retrieval result: the mechanism, how similar its best proven scope is to the query, and its gain there."""
    mechanism_id: int
    mechanism: Mechanism
    score: int  # weighted scope similarity of the best-matching passing evidence
    matched: tuple[str, ...]  # Scope fields equal to the query's in that evidence
    best_gain: float  # best gain among passing evidence at that similarity
    proven_on: Scope
    proven_in_run: str
    passing_evidence: int  # all passing rows of this mechanism, any scope
