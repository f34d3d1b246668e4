"""BatchEngine: the batched speculative-decoding loop (schedule -> draft -> verify -> commit), greedy, lossless.

Each step: admit arrived requests (runner rows + KV pages), pick each decoding request's draft (stock: a
fixed length; goodput: per request), trim drafts to the step's verify budget (cost_curve) (with device_draft both
are chosen on the device at the end of the previous step: device_policy.py), launch one fused
forward over every request's block and prompt chunk (with device_draft or a block drafter, drafting every row's
next chain inside it), draft ahead on the host while it runs (overlap_draft), read the
accepted counts (the step's one host sync) and commit each request's ragged tokens, cut at EOS and at its
token limit exactly as engines.engine.SpecEngine cuts them. Every committed token is the target's argmax
after an identical prefix, computed with row-invariant kernels: each request's output equals its
single-request AR output from SpecEngine (kernel_backend=triton).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from specpilot.engines.batch.clock import Clock, WallClock
from specpilot.engines.batch.block_drafting import BatchBlockDrafter
from specpilot.engines.batch.config import BatchConfig, DraftLength, VerifyBudget, longest_draft
from specpilot.engines.batch.cost import CostCurve, measure_cost_curve
from specpilot.engines.batch.drafting import DrafterFactory, NgramChainDrafter
from specpilot.engines.batch.mechanisms import (AcceptanceEstimate, allocate_verify_budget, goodput_draft_lens,
                                                request_costs)
from specpilot.engines.batch.ngram_drafting import BatchNgramDrafter
from specpilot.engines.batch.runner import BatchRunner, StepEntry
from specpilot.engines.batch.scheduler import Request, RequestState, Scheduler, StopReason
from specpilot.collector import collector_paused
from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig, VerifyMode


@dataclass(frozen=True)
class RequestSpec:
    id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float = 0.0  # on the run's clock (seconds, or steps with StepClock)


@dataclass(frozen=True)
class RequestResult:
    id: str
    tokens: list[int]
    stop_reason: str
    prompt_tokens: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    steps: int
    drafted: int
    accepted: int

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None for a one-token output)."""
        return (self.finish_s - self.first_token_s) / (len(self.tokens) - 1) if len(self.tokens) > 1 else None

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True)
class StepStat:
    decode: int  # requests verifying
    prefill_tokens: int
    tokens: int  # tokens in the forward
    committed: int
    wall_s: float
    draft_s: float  # host time before the launch: schedule, draft (outside the forward's shadow)
    wait_s: float = 0.0  # launched to result: the forward's remainder (and drafting ahead in its shadow), the sync


@dataclass
class RunResult:
    requests: list[RequestResult]
    wall_s: float
    steps: list[StepStat] = field(default_factory=list)
    ahead_tried: int = 0
    ahead_hits: int = 0

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def throughput(self) -> float:
        return self.new_tokens / max(self.wall_s, 1e-9)


class BatchEngine:
    def __init__(self, runner: BatchRunner, cfg: EngineConfig, batch: BatchConfig, eos: frozenset[int],
                 drafter_factory: DrafterFactory | None = None, cost_curve: CostCurve | None = None,
                 block_drafter: BatchBlockDrafter | None = None):
        if cfg.verify is not VerifyMode.CHAIN:
            raise ConfigError("the batched engine verifies chains (verify=chain)")
        if cfg.lookup_agree_topk:
            raise ConfigError("lookup_agree_topk gates the lookup on the block's depth-1 probabilities; the batched "
                              "block drafter computes top-1 tokens only (a fused argmax head): single regime only")
        if cfg.device_overlap:
            raise ConfigError("device_overlap queues the single-request device loop's chunks; the batched engine "
                              "runs its own step loop: single regime only")
        if drafter_factory is None and cfg.drafter not in (DrafterKind.NONE, DrafterKind.NGRAM, DrafterKind.BLOCK):
            raise ConfigError(f"drafter={cfg.drafter.value} is not batched yet (block, ngram, none, or a "
                              "drafter_factory)")
        block = block_drafter if cfg.drafter is DrafterKind.BLOCK else None
        if block is not None:
            _check_block(block, runner, cfg, batch)
        elif cfg.drafter is DrafterKind.BLOCK and drafter_factory is None:
            raise ConfigError("drafter=block needs the drafter: block_drafter=BatchBlockDrafter(...)")
        elif block_drafter is not None:
            raise ConfigError(f"a block_drafter was given but drafter={cfg.drafter.value}")
        self.runner, self.cfg, self.batch, self.eos = runner, cfg, batch, frozenset(eos)
        self.speculative = drafter_factory is not None or cfg.speculative
        self.k_max = longest_draft(cfg, batch) if self.speculative else 0
        if self.k_max + 1 > runner.W:
            raise ConfigError(f"drafts of {self.k_max} tokens need a runner block width of {self.k_max + 1}, "
                              f"it has {runner.W}")
        if batch.extrapolate and (cfg.drafter is not DrafterKind.NGRAM or drafter_factory is not None):
            raise ConfigError("extrapolate continues the engine's own prompt lookup: drafter=ngram, no drafter_factory")
        lookup = (_device_lookup(runner, cfg, self.k_max, drafter_factory, batch.needs_cost_curve, batch.extrapolate)
                  if batch.device_draft else None)
        # mechanisms a / b on the device, inside the step that drafts (None: on the host, in _draft)
        self.policy = lookup.policy if lookup is not None and batch.needs_cost_curve else None
        # The runner's drafter whose chains come back with each step's result (None: drafts from the host alone)
        self.device = block if block is not None else lookup
        if drafter_factory is None and not batch.device_draft and (cfg.drafter is DrafterKind.NGRAM or
                                                                   cfg.ngram_prefix):
            # n-gram: the draft; a block drafter's ngram_prefix: the lookup that leads its chain
            drafter_factory = lambda req: NgramChainDrafter(  # noqa: E731
                self.k_max, cfg.ngram_max, cfg.ngram_min, batch.extrapolate, runner.vocab)
        self.drafter_factory = drafter_factory
        self.sched = Scheduler(batch, runner.cache, cfg.max_seq_len, runner.B)
        self.cost_curve = cost_curve
        if self.cost_curve is None and batch.cost_curve:
            self.cost_curve = CostCurve(batch.cost_curve)
        if self.cost_curve is None and batch.needs_cost_curve and self.speculative:
            self.cost_curve = measure_cost_curve(runner)
        if self.policy is not None:
            self.policy.set_curve(self.cost_curve)
        self.overhead_s = 0.0  # host time per step beyond the forward (decayed average, for the mechanisms)
        self._last_tokens = 0
        self._stats: RunResult | None = None

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self, specs: Sequence[RequestSpec], clock: Clock | None = None) -> RunResult:
        """Serves every request, each joining at its arrival time; returns per-request outputs and timings."""
        clock = clock or WallClock()
        pending = deque(sorted(specs, key=lambda s: s.arrival_s))
        reqs: list[Request] = []
        self._stats = RunResult([], 0.0)
        with collector_paused():  # a full collection over every request's growing lists stalls a step
            clock.start()
            self._serve(pending, reqs, clock)
        stats, self._stats = self._stats, None
        stats.wall_s = clock.now()
        stats.requests = [RequestResult(r.id, list(r.out), r.stop.value, len(r.prompt), r.arrival_s,
                                        r.first_token_s, r.finish_s, r.steps, r.drafted, r.accepted) for r in reqs]
        return stats

    def _serve(self, pending: deque, reqs: list, clock: Clock) -> None:
        while pending or self.sched.has_work:
            while pending and pending[0].arrival_s <= clock.now():
                s = pending.popleft()
                req = Request(s.id, list(s.prompt), s.max_new_tokens, s.arrival_s)
                self.sched.add(req)
                reqs.append(req)
            if not self.sched.has_work:
                clock.wait_until(pending[0].arrival_s)
                continue
            self.step(clock)
            clock.tick()

    def step(self, clock: Clock) -> None:
        t0 = time.perf_counter()
        fresh = []
        for req in self.sched.admit(clock.now()):
            self.runner.bind(req.row, req.pages)
            fresh.append(req.row)
            if self.speculative:
                req.drafter = self.drafter_factory(req) if self.drafter_factory is not None else None
                if self.policy is None:
                    req.estimate = AcceptanceEstimate(self.batch.accept_prior, self.batch.accept_decay)
        plan = self.sched.plan()
        drafts = self._draft(plan.decode, sum(e - s for _, s, e in plan.prefill))
        entries = [StepEntry(r.row, r.prompt[s:e], s, last_only=True) for r, s, e in plan.prefill]
        entries += [StepEntry(r.row, [r.seq[-1]] + d, len(r.seq) - 1) for r, d in zip(plan.decode, drafts)]
        if self.policy is not None:
            self._stage_policy(plan, fresh, sum(len(e.tokens) for e in entries))
        t1 = time.perf_counter()
        # packs the inputs, uploads them, replays (asynchronous on CUDA); with a device drafter the same forward
        # feeds it this step's tokens and drafts every row's next chain (out[row, 1 + W:])
        handle = self.runner.launch(entries, draft=self.device)
        t_launched = time.perf_counter()
        if self.batch.overlap_draft:  # runs while the device verifies (CUDA is asynchronous)
            for req, d in zip(plan.decode, drafts):
                self._draft_ahead(req, d)
        out = handle.result().tolist()  # Python ints once: per-element numpy reads cost ~1 us each
        t2 = time.perf_counter()
        now = clock.now()
        committed = 0
        for req, start, end in plan.prefill:
            req.prefilled = end
            if end == len(req.prompt):  # the last chunk: its greedy token is the first output token
                req.state, req.first_token_s = RequestState.DECODE, now
                req.block = self.device.chain(out[req.row][1 + self.runner.W:]) if self.device is not None else None
                committed += self._commit(req, [out[req.row][1]], now)
        for req, d in zip(plan.decode, drafts):
            row = out[req.row]
            acc = row[0]
            req.steps, req.drafted, req.accepted = req.steps + 1, req.drafted + len(d), req.accepted + acc
            if req.estimate is not None:
                req.estimate.update(len(d), acc)
            new = row[1:acc + 2]  # accepted drafts (== argmax) + the bonus token
            if req.ahead is not None:
                self._check_ahead(req, d, new)
            if self.device is not None:
                req.block = self.device.chain(row[1 + self.runner.W:])
            committed += self._commit(req, new, now)
        wall = time.perf_counter() - t0
        prefill_tokens = sum(e - s for _, s, e in plan.prefill)
        tokens = len(plan.decode) + sum(len(d) for d in drafts) + prefill_tokens
        if self.cost_curve is not None:
            self.overhead_s = 0.8 * self.overhead_s + 0.2 * max(0.0, wall - float(self.cost_curve.at(tokens)))
        self._last_tokens = tokens
        if self._stats is not None:
            self._stats.steps.append(StepStat(len(plan.decode), prefill_tokens, tokens, committed, wall, t1 - t0,
                                                t2 - t_launched))

    # ---- drafting -----------------------------------------------------------------------------------
    def _draft(self, decode: list[Request], prefill_tokens: int) -> list[list[int]]:
        if not self.speculative or not decode:
            return [[] for _ in decode]
        caps = [min(self.k_max, r.remaining - 1) for r in decode]  # the bonus token fills the last place
        if self.batch.draft_length is DraftLength.GOODPUT and self.policy is None:
            fixed_s, token_s = request_costs(self.cost_curve, self.overhead_s, len(decode),
                                             max(self._last_tokens, len(decode)))
            caps = goodput_draft_lens([r.estimate.alpha for r in decode], caps, fixed_s, token_s)
        drafts = []
        for req, cap in zip(decode, caps):
            ready, req.ready = req.ready, None
            block, req.block = req.block or [], None
            if cap <= 0:
                drafts.append([])
            elif ready is not None:  # drafted ahead, during the previous step's forward
                drafts.append(ready[:cap])
            else:
                lead = list(req.drafter.propose(req.seq, cap))[:cap] if req.drafter is not None else []
                # a block drafter's depths do not depend on each other: the lookup's match leads, the block's top-1
                # tokens follow from the depth after it (engines.drafters.ngram_prefix); a device lookup's chain
                # is the whole draft (no host drafter)
                drafts.append(lead + block[len(lead):cap])
        if self.batch.verify_budget is VerifyBudget.COST_CURVE and self.policy is None:
            keep = allocate_verify_budget([r.estimate.alpha for r in decode], [len(d) for d in drafts],
                                          len(decode) + prefill_tokens, self.cost_curve, self.overhead_s,
                                          self.batch.verify_budget_max)
            drafts = [d[:k] for d, k in zip(drafts, keep)]
        return drafts

    def _stage_policy(self, plan, fresh: list[int], tokens: int) -> None:
        """The device policy's inputs for this step's launch, which drafts the next step: every row that will draft
        (decoding, or finishing its prompt) with its token limit, rows bound to new requests, the prices."""
        remaining = {r.row: r.remaining for r in plan.decode}
        remaining.update((r.row, r.remaining) for r, _, end in plan.prefill if end == len(r.prompt))
        fixed_s, token_s = request_costs(self.cost_curve, self.overhead_s, max(1, len(remaining)), tokens)
        b = self.batch
        self.policy.stage(goodput=b.draft_length is DraftLength.GOODPUT,
                          budget=b.verify_budget is VerifyBudget.COST_CURVE, k_max=self.k_max, fixed_s=fixed_s,
                          token_s=token_s, overhead_s=self.overhead_s, budget_cap=b.verify_budget_max,
                          prior=b.accept_prior, decay=b.accept_decay, remaining=remaining, fresh=fresh)

    def _draft_ahead(self, req: Request, draft: list[int]) -> None:
        """Drafts for the outcome "all of `draft` accepted" while the forward runs (mechanism c)."""
        ahead = getattr(req.drafter, "propose_ahead", None)
        if ahead is None or req.remaining - len(draft) - 1 < 2:
            return  # no such drafter, or the request cannot take another draft after this step
        req.ahead = ahead(req.seq, draft, self.k_max)
        if self._stats is not None:
            self._stats.ahead_tried += 1

    def _check_ahead(self, req: Request, draft: list[int], new: list[int]) -> None:
        ahead, req.ahead = req.ahead, None
        # every draft token accepted and the bonus guessed right: the rest is the next step's draft
        if len(ahead) > 1 and len(new) == len(draft) + 1 and new[-1] == ahead[0]:
            req.ready = ahead[1:]
            if self._stats is not None:
                self._stats.ahead_hits += 1

    # ---- commit -------------------------------------------------------------------------------------
    def _commit(self, req: Request, new: list[int], now: float) -> int:
        """Appends the step's tokens cut at the token limit and at the first EOS (inclusive), as SpecEngine's
        stock policy does; finishes the request when it stops."""
        new = new[:req.remaining]
        stop = None
        if not self.eos.isdisjoint(new):  # (a set test first: the loop below costs a step ~1 us a token)
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new, stop = new[:i + 1], StopReason.EOS
                    break
        req.seq.extend(new)
        req.out.extend(new)
        if stop is None and req.remaining <= 0:
            stop = StopReason.MAX_TOKENS
        if stop is not None:
            self.runner.unbind(req.row)
            self.sched.finish(req, stop, now)
        return len(new)


def _device_lookup(runner: BatchRunner, cfg: EngineConfig, k_max: int, drafter_factory: DrafterFactory | None,
                   policy: bool, extrapolate: bool) -> BatchNgramDrafter:
    """The runner's BatchNgramDrafter this engine's device_draft uses: with a DevicePolicy where goodput or the
    verify budget is on, extrapolating where extrapolate is (checked against its lookup settings)."""
    if cfg.drafter is not DrafterKind.NGRAM or drafter_factory is not None:
        raise ConfigError("device_draft runs prompt lookup on the device: drafter=ngram, no drafter_factory")
    lookups = [d for d in runner.drafters if isinstance(d, BatchNgramDrafter) and (d.policy is not None) == policy
               and d.extrapolate == extrapolate]
    if len(lookups) != 1:
        kind = "with a DevicePolicy (goodput / verify budget on)" if policy else "without a policy"
        raise ConfigError(f"device_draft needs a runner built with one BatchNgramDrafter {kind}, "
                          f"{'' if extrapolate else 'not '}extrapolating; it has {len(lookups)} (build_batch_engine "
                          "makes one)")
    d = lookups[0]
    if (d.ngram_min, d.ngram_max) != (cfg.ngram_min, cfg.ngram_max) or d.depth < k_max:
        raise ConfigError(f"the runner's lookup (ngram {d.ngram_min}..{d.ngram_max}, {d.depth} tokens) is not this "
                          f"engine's (ngram {cfg.ngram_min}..{cfg.ngram_max}, {k_max} tokens)")
    if d.capacity < cfg.max_seq_len:
        raise ConfigError(f"the runner's lookup holds {d.capacity} positions a row; max_seq_len is {cfg.max_seq_len}")
    return d


def _check_block(block: BatchBlockDrafter, runner: BatchRunner, cfg: EngineConfig, batch: BatchConfig) -> None:
    if not any(d is block for d in runner.drafters):
        raise ConfigError("the runner was not built with this block drafter (drafters=[it, ...])")
    if block.capacity < cfg.max_seq_len:  # (its rows: the runner checked them against its own)
        raise ConfigError(f"the block drafter holds {block.capacity} positions a row; max_seq_len is {cfg.max_seq_len}")
    if cfg.block_size > block.config.block_size:
        raise ConfigError(f"block_size={cfg.block_size} exceeds the drafter's trained block size "
                          f"{block.config.block_size}")
    if batch.overlap_draft:
        raise ConfigError("overlap_draft guesses the next draft from the lookup while the target verifies; a block "
                          "drafter drafts from the verified step's features, after it: turn overlap_draft off")
