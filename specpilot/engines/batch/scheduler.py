"""Continuous batching for speculative decoding: requests join and leave at every step.

A request waits (FIFO) until a runner row and every KV page it can need are free, is admitted, prefills in
chunks (prompt tokens of all prefilling requests share a per-step budget, and share the step with the
decoding requests), then decodes: each step it verifies its pending token plus its own draft and commits
its own ragged number of tokens. It leaves on EOS or its token limit, and its row and pages are reused by
the next waiting request at the next step. Host-side only: the runner does the device work.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from specpilot.engines.batch.config import BatchConfig
from specpilot.engines.batch.mechanisms import AcceptanceEstimate
from specpilot.engines.batch.paged_cache import PagedKVCache, pages_for


class RequestState(str, Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class StopReason(str, Enum):
    EOS = "eos"
    MAX_TOKENS = "max_tokens"


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0
    state: RequestState = RequestState.WAITING
    row: int = -1  # the runner row bound to it while running
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens whose KV is in the cache
    seq: list[int] = field(default_factory=list)  # prompt + committed output; seq[-1] is pending while decoding
    out: list[int] = field(default_factory=list)
    stop: StopReason | None = None
    drafter: object = None
    estimate: AcceptanceEstimate | None = None
    ahead: list[int] | None = None  # overlap: tokens drafted after "the draft being verified all accepted"
    ready: list[int] | None = None  # overlap: that guess came true; the next draft is already there
    block: list[int] | None = None  # the block drafter's next chain, drafted inside the request's last step
    # timings (engine clock) and counters
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    steps: int = 0  # decode steps taken
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.id!r}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.id!r}: max_new_tokens must be >= 1")
        self.seq = list(self.prompt)

    @property
    def positions(self) -> int:
        """KV positions the request can ever write: prompt + every new token but the last (never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.out)


@dataclass
class StepPlan:
    prefill: list[tuple[Request, int, int]]  # (request, first prompt index, end index) chunks of this step
    decode: list[Request]  # requests verifying their pending token (+ draft) this step

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, cfg: BatchConfig, cache: PagedKVCache, max_seq_len: int, rows: int):
        """rows: the runner's request rows (>= cfg.max_batch, the running-request cap: one runner can serve
        engines of several concurrencies)."""
        if rows < cfg.max_batch:
            raise ValueError(f"max_batch={cfg.max_batch} exceeds the runner's {rows} request rows")
        self.cfg, self.cache, self.max_seq_len = cfg, cache, max_seq_len
        self.max_running = cfg.max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_rows = list(range(rows - 1, -1, -1))

    def add(self, req: Request) -> None:
        if req.state is not RequestState.WAITING:
            raise ValueError(f"request {req.id!r} was already scheduled ({req.state.value})")
        if len(req.prompt) + req.max_new_tokens + 1 > self.max_seq_len:
            raise ValueError(f"request {req.id!r}: prompt ({len(req.prompt)}) + max_new_tokens "
                             f"({req.max_new_tokens}) exceeds max_seq_len ({self.max_seq_len})")
        if pages_for(req.positions, self.cache.shape.page) > self.cache.shape.num_pages:
            raise ValueError(f"request {req.id!r} needs more KV pages than the whole cache has")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, now: float = 0.0) -> list[Request]:
        """Admits waiting requests in arrival order while a row and their pages are free (no overtaking: a
        large request at the head is not starved by smaller ones behind it)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running and self._free_rows:
            req = self.waiting[0]
            if not self.cache.can_hold(req.positions):
                break
            self.waiting.popleft()
            req.pages = self.cache.allocate(req.positions)
            req.row = self._free_rows.pop()
            req.state, req.admitted_s = RequestState.PREFILL, now
            self.running.append(req)
            admitted.append(req)
        return admitted

    def plan(self) -> StepPlan:
        """Every decoding request, plus prompt chunks (oldest first) within the per-step prefill budget."""
        budget = self.cfg.prefill_chunk
        prefill = []
        for req in self.running:
            if req.state is RequestState.PREFILL and budget > 0:
                end = min(len(req.prompt), req.prefilled + budget)
                prefill.append((req, req.prefilled, end))
                budget -= end - req.prefilled
        decode = [r for r in self.running if r.state is RequestState.DECODE]
        return StepPlan(prefill, decode)

    def finish(self, req: Request, reason: StopReason, now: float = 0.0) -> None:
        req.state, req.stop, req.finish_s = RequestState.FINISHED, reason, now
        self.running.remove(req)
        self.cache.release(req.pages)
        self._free_rows.append(req.row)
        req.pages, req.drafter, req.ahead, req.ready = [], None, None, None
