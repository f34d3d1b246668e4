"""The engine loop: draft -> verify -> commit, single request, greedy."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Protocol

from specpilot.collector import collector_paused
from specpilot.engines.device_loop import CALIBRATION_STEPS, DeviceLoop, LoopSteps
from specpilot.engines.drafters.base import DraftTree, Drafter
from specpilot.engines.policy import STOCK, EnginePolicy
from specpilot.engines.layout import draft_layout
from specpilot.engines.runner import ModelRunner
from specpilot.engines.traces import StepTrace


@dataclass
class Acceptance:
    path: list[int]  # block indices of the accepted nodes, root (0) first
    tokens: list[int]  # accepted draft tokens followed by the bonus token


def greedy_accept(block_tokens: list[int], parents: list[int], argmax: list[int]) -> Acceptance:
    """Longest root path whose every token equals the target's argmax at its parent, plus one bonus token.

    block_tokens[0] is the root (last committed token); parents index into the block (parents[0] = -1).
    Children are tried in block order, so among equal-depth candidates the earliest node wins.
    """
    # One pass in block order: a node's children all follow it, so the first later node that hangs off the current
    # one and matches its argmax is its earliest matching child (no children lists to build each step).
    path, node, want = [0], 0, argmax[0]
    for i in range(1, len(parents)):
        if parents[i] == node and block_tokens[i] == want:
            path.append(i)
            node, want = i, argmax[i]
    return Acceptance(path, [block_tokens[i] for i in path[1:]] + [want])


def _path_rows(features, path: list[int]):
    """features' rows `path`: a slice when the path is the block's first rows (a chain's accepted prefix), so no
    index tensor is built and, on CUDA, copied from pageable host memory with a stream sync every step."""
    if path[-1] == len(path) - 1 and path == list(range(len(path))):
        return features[:len(path)]
    return features[path]


@dataclass
class GenerationResult:
    tokens: list[int]
    stop_reason: str  # "eos" or "max_tokens"
    prefill_s: float
    decode_s: float
    steps: list[StepTrace] = field(default_factory=list)

    @property
    def accepted_per_step(self) -> float:
        return sum(s.committed for s in self.steps) / max(1, len(self.steps))


# AR decoding runs up to this many greedy steps per host round trip (ModelRunner.decode: one graph, each step's
# token fed on the device; EngineConfig.ar_steps); the steps are the same forwards as one at a time, so the tokens
# are identical.
AR_STEPS_PER_SYNC = 4


class SwitchedBudgetFields(Protocol):
    """The fields StepBudgets reads: an EngineConfig's, and the replay's LookupPolicy's (the same names)."""
    narrow_tree_budget: int
    tree_budget: int
    wide_tree_after: int
    deep_tree_budget: int
    deep_tree_after: int
    deep_tree_chain: bool


@dataclass(frozen=True)
class StepBudgets:
    """EngineConfig.narrow_tree_budget / deep_tree_budget: step j verifies a tree of `deep` nodes where step j - 2
    accepted at least `deep_after` draft tokens (deep 0: never), else of `wide` nodes where it accepted at least
    `after`, else of `narrow` (0: wide's). Two steps back: known to the host when it queues an overlapped chunk.
    deep_chain (EngineConfig.deep_tree_chain): the deep step's `deep` nodes are a chain, not a grown tree."""
    narrow: int
    wide: int
    after: int
    deep: int = 0
    deep_after: int = 0
    deep_chain: bool = False

    @classmethod
    def from_config(cls, cfg: SwitchedBudgetFields) -> StepBudgets | None:
        """cfg's switched budgets, or None where it verifies tree_budget's tree every step."""
        if not (cfg.narrow_tree_budget or cfg.deep_tree_budget):
            return None
        return cls(cfg.narrow_tree_budget, cfg.tree_budget, cfg.wide_tree_after, cfg.deep_tree_budget,
                   cfg.deep_tree_after, cfg.deep_tree_chain)

    def budget(self, steps: list[StepTrace], j: int) -> int:
        return self.following(steps[j - 2].accepted if j >= 2 else -1)

    def following(self, accepted: int) -> int:
        """The budget of a step whose step two before accepted `accepted` draft tokens (-1: no such step)."""
        if self.deep and accepted >= self.deep_after:
            return self.deep
        return self.wide if accepted >= self.after or not self.narrow else self.narrow

    def is_chain(self, budget: int) -> bool:
        """Whether a step of `budget` nodes verifies a chain (the deep step with deep_chain)."""
        return self.deep_chain and budget == self.deep

    @property
    def extra(self) -> tuple[int, ...]:
        """The budgets besides `wide` (the device loop holds a grown tree for each)."""
        return tuple(b for b in (self.narrow, self.deep) if b)


class SpecEngine:
    """AR decoding when drafter is None; otherwise speculative decoding with greedy verification. budgets: a tree
    budget per step (block drafters' grown trees), else the drafter's own."""

    def __init__(self, target: ModelRunner, drafter: Drafter | None, eos: frozenset[int], max_depth: int = 64,
                 policy: EnginePolicy = STOCK, ar_steps: int = AR_STEPS_PER_SYNC,
                 device_loop: DeviceLoop | None = None, budgets: StepBudgets | None = None):
        self.target, self.drafter, self.eos, self.policy = target, drafter, frozenset(eos), policy
        self.budgets = budgets
        self.max_depth = min(max_depth, target.block_width - 1)
        # Several AR steps per sync need a runner that can chain them, and the stock accept (a policy that
        # rewrites acceptance must see every step).
        chains = getattr(target, "decode", None) is not None and type(policy).accept is EnginePolicy.accept
        self.ar_steps = max(1, min(ar_steps, target.block_width)) if drafter is None and chains else 1
        # Speculative steps on the device draft full depth and accept greedily: only where the policy turns
        # neither (a policy that picks depths, shapes trees or rewrites acceptance must see every step).
        stock = all(getattr(type(policy), hook) is getattr(EnginePolicy, hook)
                    for hook in ("draft_depth", "shape_tree", "accept"))
        self.device_loop = device_loop if stock else None
        if type(policy).commit is EnginePolicy.commit:  # the device skips steps past this rule's stops
            if self.device_loop is not None:
                self.device_loop.stop_on(self.eos)
            if self.ar_steps > 1 and hasattr(target, "stop_decodes_on"):
                target.stop_decodes_on(self.eos)

    def warm_up(self, prompt: list[int], max_new_tokens: int = 8) -> None:
        """A short generation, then every graph this engine's target can replay: one-time costs (allocation,
        kernel compilation, graph capture) stay out of the timed generations that follow. A device loop that still
        calibrates its static tree gets a generation long enough to fix it first."""
        self.generate(prompt, max_new_tokens)
        if self.device_loop is not None and not self.device_loop.ready:
            room = self.target.cfg.max_seq_len - len(prompt) - 1
            self.generate(prompt, max(1, min(room, 4 * CALIBRATION_STEPS)))
        capture_all = getattr(self.target, "capture_all", None)
        if capture_all is not None:
            capture_all(decode_steps=self.ar_steps if self.ar_steps > 1 else 0)
        capture_drafter = getattr(self.drafter, "capture_all", None)  # graph-captured drafters (block drafter)
        if capture_drafter is not None:
            capture_drafter()
        if self.device_loop is not None:
            self.device_loop.capture_all()

    def generate(self, prompt: list[int], max_new_tokens: int, request_id: str = "") -> GenerationResult:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(prompt) + max_new_tokens + 1 > self.target.cfg.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                             f"({self.target.cfg.max_seq_len})")
        self.policy.begin_request(list(prompt), max_new_tokens)
        cached = self.policy.cached_response(list(prompt), max_new_tokens)
        if cached is not None:
            return GenerationResult(list(cached), "cached", 0.0, 0.0)
        if self.drafter is not None:
            self.drafter.reset()
        self.target.begin_request(len(prompt) + max_new_tokens)
        with collector_paused():
            return self._generate(prompt, max_new_tokens, request_id)

    def _generate(self, prompt: list[int], max_new_tokens: int, request_id: str) -> GenerationResult:
        t0 = time.perf_counter()
        pre = self.target.prefill(prompt)
        first = pre.argmax[0]
        observe = getattr(self.drafter, "observe", None)  # drafters that read target features (block drafter)
        if observe is not None:
            observe(0, pre.features)
        t1 = time.perf_counter()
        seq, out, steps = list(prompt), [first], []
        seq.append(first)
        stop = "eos" if first in self.eos else ("max_tokens" if max_new_tokens == 1 else "")
        while not stop:
            base = len(seq) - 1  # slot of the pending token, whose KV is not computed yet
            remaining = max_new_tokens - len(out)
            ts = time.perf_counter()
            if self.ar_steps > 1 and remaining > 1:
                k = 1 << (min(self.ar_steps, remaining).bit_length() - 1)  # a power of two: few graphs
                new, stopped = self.policy.commit(self.target.decode(base, seq[-1], k), self.eos, remaining)
                stop = "eos" if stopped else ("max_tokens" if len(out) + len(new) >= max_new_tokens else "")
                dt = (time.perf_counter() - ts) / len(new)
                for i, tok in enumerate(new):  # one trace per AR step, as if each had its own round trip
                    steps.append(StepTrace(request_id=request_id, step=len(steps), position=base + 1 + i, drafted=0,
                                           depth=0, accepted=0, committed=1, verify_tokens=1, draft_s=0.0,
                                           verify_s=dt))
                seq.extend(new)
                out.extend(new)
                continue
            loop = self.device_loop
            if loop is not None and loop.ready and remaining > 1 and loop.fits(base, loop.chunk_steps(remaining)):
                first = len(steps)  # the stream's i-th chunk is this request's step first + i (one step a chunk)
                budget_of = None if self.budgets is None else (
                    lambda i: self.budgets.budget(steps, first + i))  # noqa: E731
                with contextlib.closing(loop.stream(seq, remaining, budget_of)) as chunks:  # closing: queued ends
                    for res in chunks:
                        stop = self._commit_loop_steps(res, len(seq) - 1, seq, out, steps, max_new_tokens,
                                                       request_id)
                        if stop:
                            break
                continue
            # Drafting deeper than remaining-1 is waste: the bonus token already fills the last place.
            depth = self.policy.draft_depth(steps, min(self.max_depth, remaining - 1))
            budget = {}
            if self.budgets is not None:
                b = self.budgets.budget(steps, len(steps))
                budget = {"budget": b, "chain": self.budgets.is_chain(b)}
            tree = (self.policy.shape_tree(self.drafter.propose(seq, depth, **budget)) if self.drafter and depth > 0
                    else DraftTree())
            if loop is not None and not loop.ready and tree.topk_probs:
                loop.calibrate(tree.topk_probs)  # a tree device loop's static shape, from the host steps' drafts
            tv = time.perf_counter()
            block = [seq[-1]] + tree.tokens
            layout = draft_layout(tuple(tree.parents))  # parents, depths, ancestors: once per tree shape
            result = self.target.verify(base, block, list(layout.depths), layout.anc)
            acc = self.policy.accept(block, list(layout.parents), result.argmax)
            self.target.compact(base, acc.path)
            if observe is not None:  # features of the root and the accepted nodes, now at slots base..
                observe(base, _path_rows(result.features, acc.path))
            new, stopped = self.policy.commit(acc.tokens, self.eos, remaining)
            stop = "eos" if stopped else ""
            seq.extend(new)
            out.extend(new)
            if not stop and len(out) >= max_new_tokens:
                stop = "max_tokens"
            te = time.perf_counter()
            steps.append(StepTrace(
                request_id=request_id, step=len(steps), position=base + 1, drafted=len(tree),
                depth=layout.max_depth, accepted=len(acc.path) - 1, committed=len(new), verify_tokens=len(block),
                draft_s=tv - ts, verify_s=te - tv, topk_tokens=tree.topk_tokens, topk_probs=tree.topk_probs))
        for s in steps:  # the target's actual continuation from each step, for exact replay
            start = s.position - len(prompt)
            s.target_tokens = out[start:start + self.max_depth + 1]  # not out[start:][:k]: O(steps * len(out))
        return GenerationResult(out, stop, t1 - t0, time.perf_counter() - t1, steps)

    def _commit_loop_steps(self, res: LoopSteps, base: int, seq: list[int], out: list[int], steps: list[StepTrace],
                           max_new_tokens: int, request_id: str) -> str:
        """Commits a device loop's steps in order up to a stop; their wall time is shared equally (in verify_s:
        draft and verify are not timed apart on the device). Returns the stop reason ("" to go on)."""
        per_step, nodes = res.seconds / len(res.accepted), res.nodes
        for i, acc in enumerate(res.accepted.tolist()):
            new, stopped = self.policy.commit(res.path_tokens[i, :acc + 1].tolist(), self.eos,
                                              max_new_tokens - len(out))
            drafted = int(res.proposed[i]) if res.chain else nodes  # a chain's filler depths are not drafts
            steps.append(StepTrace(
                request_id=request_id, step=len(steps), position=base + 1, drafted=drafted,
                depth=drafted if res.chain else res.max_depth, accepted=acc, committed=len(new),
                verify_tokens=nodes + 1, draft_s=0.0, verify_s=per_step,
                topk_tokens=res.topk_tokens[i, :drafted].tolist(), topk_probs=res.topk_probs[i, :drafted].tolist()))
            seq.extend(new)
            out.extend(new)
            base += len(new)
            if stopped:
                return "eos"
            if len(out) >= max_new_tokens:
                return "max_tokens"
        if res.stopped:  # the device skipped steps the host would commit: its stop rule is not the host's
            raise RuntimeError("device loop: the device stopped the request where the host did not")
        return ""
