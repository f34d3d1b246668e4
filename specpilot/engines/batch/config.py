"""BatchConfig: the batched engine's sizing and its mechanisms, one frozen, validated dataclass.

The mechanisms (each alone or together; MECHANISMS names their deltas from stock):
- draft_length=goodput (a): each request's draft length is re-chosen every step from its recent acceptance,
  maximising expected tokens per unit of step cost (goodput), not acceptance;
- verify_budget=cost_curve (b): one verify-token budget per step, sized from the target forward's cost curve
  and handed to the (request, position) slots most likely to be accepted;
- device_draft (c): the n-gram lookup runs on the device inside the verify step's own forward (its CUDA graph),
  every row's next draft from its on-device acceptance, returned with the step's result: the host drafts nothing
  (engines/batch/ngram_drafting.py). The host's share of a batched step was 30-45% on the H200, drafting its
  largest part.
- overlap_draft (c's host-side predecessor, kept as a knob): while the GPU verifies step s, the host drafts step
  s+1 for the outcome "every draft token accepted" and keeps it when that outcome happens. Excludes device_draft.
- extrapolate (d): where the text repeats with a period and a token changes by a small id step from one period to
  the next (a count: `if n == 216:` ... `if n == 218:`), the lookup proposes the next step instead of a copy, and a
  proposal of the whole period goes on repeating the loop up to the draft length (drafting.extrapolate_period). The
  bench's run was as long as its one counting request (notes/h200.md, sessions 18-19).
"all" is a, b, c and d (ALL_MECHANISMS). Stock (all off) is what SGLang / vLLM ship for n-gram: a fixed draft length
for every request, every step, drafted on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from specpilot.engines.config import ConfigError, ConfigOps, DrafterKind, EngineConfig, config_schema


class DraftLength(str, Enum):
    FIXED = "fixed"  # EngineConfig.draft_len for every request (stock)
    GOODPUT = "goodput"  # per request, per step, up to max_draft_len (mechanism a)


class VerifyBudget(str, Enum):
    OFF = "off"  # verify every drafted token (stock)
    COST_CURVE = "cost_curve"  # a per-step budget sized from the cost curve (mechanism b)


MECHANISMS: dict[str, dict[str, Any]] = {
    "goodput_draft": {"draft_length": DraftLength.GOODPUT},
    "verify_budget": {"verify_budget": VerifyBudget.COST_CURVE},
    "overlap_draft": {"overlap_draft": True},
    "device_draft": {"device_draft": True},
    "extrapolate": {"extrapolate": True},
}
# what "all" turns on (overlap: excluded)
ALL_MECHANISMS = ("goodput_draft", "verify_budget", "device_draft", "extrapolate")


@dataclass(frozen=True)
class BatchConfig(ConfigOps):
    PAIR_FIELDS: ClassVar[tuple[str, ...]] = ("cost_curve",)
    max_batch: int = 24  # requests running at once (the concurrency cap); more wait in the queue
    prefill_chunk: int = 1024  # prompt tokens fused into one step (chunked prefill; prefills share steps)
    graph_max_tokens: int = 512  # largest token count captured as a CUDA graph; larger steps run eagerly
    num_pages: int = 0  # KV pages in the cache (0: room for max_batch requests of EngineConfig.max_seq_len)
    draft_length: DraftLength = DraftLength.FIXED
    max_draft_len: int = 16  # goodput: the longest draft a request may get
    verify_budget: VerifyBudget = VerifyBudget.OFF
    verify_budget_max: int = 0  # cost_curve: a hard cap on draft tokens per step (0: the curve alone decides)
    overlap_draft: bool = False
    device_draft: bool = False
    extrapolate: bool = False
    accept_decay: float = 0.7  # weight of a request's history in its acceptance estimate, per step
    accept_prior: float = 0.5  # per-token acceptance assumed before a request has any history
    # Profiled cost of the target forward: (tokens in the forward, seconds), tokens ascending. Empty: the
    # engine measures it when a mechanism needs it (on CPU too, where it then costs a few forwards).
    cost_curve: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        self._coerce_enums((("draft_length", DraftLength), ("verify_budget", VerifyBudget)))
        for name in ("max_batch", "prefill_chunk", "graph_max_tokens", "num_pages", "max_draft_len",
                     "verify_budget_max"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be an int")
        for name in ("overlap_draft", "device_draft", "extrapolate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be a bool")
        _check(not (self.overlap_draft and self.device_draft),
               "overlap_draft drafts on the host in the forward's shadow; device_draft drafts inside the forward: "
               "turn one off")
        _check(1 <= self.max_batch <= 1024, f"max_batch={self.max_batch}: must be in 1..1024")
        _check(16 <= self.prefill_chunk <= 65536, f"prefill_chunk={self.prefill_chunk}: must be in 16..65536")
        _check(16 <= self.graph_max_tokens <= 8192 and self.graph_max_tokens % 16 == 0,
               f"graph_max_tokens={self.graph_max_tokens}: must be a multiple of 16 in 16..8192")
        _check(self.num_pages >= 0, f"num_pages={self.num_pages}: must be >= 0 (0: sized from max_batch)")
        _check(1 <= self.max_draft_len <= 63, f"max_draft_len={self.max_draft_len}: must be in 1..63")
        _check(self.verify_budget_max >= 0, f"verify_budget_max={self.verify_budget_max}: must be >= 0")
        _check(0.0 <= self.accept_decay < 1.0, f"accept_decay={self.accept_decay}: must be in [0, 1)")
        _check(0.0 < self.accept_prior < 1.0, f"accept_prior={self.accept_prior}: must be in (0, 1)")
        try:
            curve = tuple((int(n), float(s)) for n, s in self.cost_curve)
        except (TypeError, ValueError):
            raise ConfigError(f"cost_curve={self.cost_curve!r}: must be (tokens, seconds) pairs") from None
        if curve:
            tokens = [n for n, _ in curve]
            _check(len(curve) >= 2 and tokens[0] >= 1 and all(a < b for a, b in zip(tokens, tokens[1:])),
                   f"cost_curve tokens {tokens}: need >= 2 points, >= 1, strictly ascending")
            _check(all(s > 0 for _, s in curve), "cost_curve seconds must all be > 0")
        object.__setattr__(self, "cost_curve", curve)

    @property
    def mechanisms(self) -> tuple[str, ...]:
        """Names (MECHANISMS keys) of the mechanisms this config turns on."""
        return tuple(name for name, delta in MECHANISMS.items()
                     if all(getattr(self, k) == v for k, v in delta.items()))

    @property
    def needs_cost_curve(self) -> bool:
        return self.draft_length is DraftLength.GOODPUT or self.verify_budget is VerifyBudget.COST_CURVE

    @classmethod
    def with_mechanisms(cls, *names: str, **fields: Any) -> "BatchConfig":
        """Stock plus the named mechanisms (MECHANISMS keys, or "all"), plus any field overrides."""
        return cls(**{**mechanism_fields(*names), **fields})


def mechanism_fields(*names: str) -> dict[str, Any]:
    """The BatchConfig fields that turn the named mechanisms on (MECHANISMS keys, or "all" alone)."""
    delta: dict[str, Any] = {}
    for name in (ALL_MECHANISMS if names == ("all",) else names):
        if name not in MECHANISMS:
            raise ConfigError(f"unknown mechanism {name!r}: expected one of {sorted(MECHANISMS)} or 'all'")
        delta.update(MECHANISMS[name])
    return delta


def longest_draft(cfg: EngineConfig, batch: BatchConfig) -> int:
    """The most draft tokens a request gets in one step: goodput's max_draft_len, else the fixed length (a block
    drafter's block depth, block_size - 1; an n-gram drafter's draft_len); 0 without a drafter."""
    if not cfg.speculative:
        return 0
    if batch.draft_length is DraftLength.GOODPUT:
        return batch.max_draft_len
    return cfg.block_size - 1 if cfg.drafter is DrafterKind.BLOCK else cfg.draft_len


def batch_knob_schema() -> list[dict[str, Any]]:
    """BatchConfig's fields with types, defaults and allowed values: what explorers may turn."""
    return config_schema(BatchConfig)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
