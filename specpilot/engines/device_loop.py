"""Speculative steps with no host round trip between them: k steps per sync, chain or tree, with a drafter
that has a device half (engines.device_drafters: the block drafter, n-gram lookup).

The host loop (SpecEngine.generate) syncs twice a step, to read the draft and the verify's argmax, and the GPU
idles while the host builds the next step (on the H200 ~0.35 ms of a ~1.8 ms chain step went to such gaps; a
best-first tree adds its Python). A step whose draft shape is fixed fits on the device: node i's token is the
drafter's candidate of rank r_i at depth d_i (one gather), the verify's argmax decides acceptance (a node is
accepted when every node on its path equals the argmax at its parent: one small matmul against the ancestor
matrix; siblings are distinct candidates, so the accepted nodes form one path and the deepest wins), the committed
tokens are the argmax at the path's nodes in depth order, the path's keys/values and features move to slots
base.., the bonus token becomes the next pending token. k steps run as one CUDA graph replay; the host reads their
tokens once, cuts them at EOS / the token limit and drops the rest (steps past a stop only cost time).

Chains have that shape by construction. A tree's shape is either calibrated (EngineConfig.device_tree): the
best-first tree of the drafter's *mean* top-k probabilities per depth and rank (`StaticTree.calibrated`), measured
over the engine's first host-loop tree steps, fixed afterwards (no work a step); or per_step: the host loop's
best-first tree of each step's own candidates, grown on the device inside the step (engines.tree_grow: one launch).

With `overlap`, the next chunk is queued before the current one's tokens are read (DeviceLoop.stream): it starts
from the device's state, so the host's work between chunks (reading, committing, traces: ~0.15 ms a 4-step chunk
on the H200 host, session 33) runs while the device works, and a stop costs the chunk queued behind it. Queued
chunks alternate between two graph sets, so a replay never overwrites pinned outputs the host has yet to read.

Steps past a stop: with the engine's stop rule (stop_on: EOS tokens, the token limit) each commit also tracks on
the device whether the request is still live (steps after the stop then count nothing; the host takes the steps
that ran), and a queued chunk's graph sits in a CUDA graph conditional node on it (engines.graph_if), so the chunk
queued behind a stop costs a few microseconds instead of its steps (session 34: with 1-step chunks that step was
2% of the overlapped chain's decode time, the short requests weighing most).

Exactness is the host loop's: every verify is the runner's step function on the same layouts. What differs is
drafter state only (rows past the accepted path are projected too, at positions no draft reads before they are
rewritten), so proposals may differ in low bits; verification decides either way.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from specpilot.costmodel.acceptance import best_first_tree
from specpilot.engines.device_drafters import DeviceDrafter
from specpilot.engines.drafters.block_tree import TreeShape
from specpilot.engines import graph_if
from specpilot.engines.config import MAX_GROWN_NODES
from specpilot.engines.graphs import capture_restoring
from specpilot.engines.layout import DraftLayout, draft_layout, verify_layout
from specpilot.engines.loop_kernels import (LoopStop, assemble, assemble_ref, chain_commit, chain_commit_ref,
                                            tree_commit, tree_commit_ref)
from specpilot.engines.fused import feature_rows
from specpilot.engines.side_stream import SideStream
from specpilot.engines.runner import ModelRunner
from specpilot.engines.tree_grow import TreeBlock, grow_tree, grow_tree_ref
from specpilot.engines.tree_move import tree_move, tree_move_ref

# Host-loop tree steps whose drafter probabilities fix a static tree's shape.
CALIBRATION_STEPS = 16
# The token limit of a run() without one.
NO_LIMIT = 1 << 62
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticTree:
    """Draft node i (0-based, parents before children; -1 = the root) is the drafter's candidate of rank ranks[i] at
    depth depths[i]."""
    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def chain(cls, depth: int) -> "StaticTree":
        return cls(tuple(range(-1, depth - 1)), (0,) * depth)

    @classmethod
    def calibrated(cls, mean_probs: np.ndarray, budget: int, width: int) -> "StaticTree":
        """The best-first tree of `budget` nodes over mean_probs [depth, K] (mean probability of each depth's rank-r
        candidate), at most `width` candidates a depth."""
        ranks = [list(range(min(width, len(p)))) for p in mean_probs]
        tree = best_first_tree(ranks, [list(p[:len(r)]) for p, r in zip(mean_probs, ranks)], budget)
        return cls(tuple(tree.parents), tuple(tree.tokens))  # the "tokens" were ranks

    @property
    def layout(self) -> DraftLayout:
        return draft_layout(self.parents)


@dataclass
class LoopSteps:
    """Host copies of k device steps' results."""
    path_tokens: np.ndarray  # [k, max_depth + 1]: commit path_tokens[i, :accepted[i] + 1] (drafts, then the bonus)
    accepted: np.ndarray  # [k] draft tokens accepted per step
    proposed: np.ndarray  # [k] depths the drafter really proposed (n-gram: up to its match's length; block: all)
    topk_tokens: np.ndarray  # [k, max_depth, K] the drafter's candidates per depth of the shape (traces: exact replay)
    topk_probs: np.ndarray
    seconds: float  # wall time of the k steps, host round trip included
    stopped: bool = False  # the device saw the request stop in these steps (with stop_on): steps past it are cut
    nodes: int = 0  # draft nodes a step verified (the block's rows - 1)
    max_depth: int = 0  # the deepest a step's path could reach
    chain: bool = False  # the steps verified a chain (proposed: its drafted depths; the rest filler)


class Glue(NamedTuple):
    """The step's own kernels around the drafter's and the target's: Triton on CUDA, torch references on CPU."""
    grow: Callable
    assemble: Callable
    chain_commit: Callable
    tree_commit: Callable
    tree_move: Callable


# A chunk's origin: FROM_HOST copies (pending token, slot) in from the host; the two CONTINUING sets start from the
# state the chunk before them left on the device, alternating (overlap).
FROM_HOST, CONTINUING = 0, (1, 2)


@dataclass
class LoopGraph:
    graph: "torch.cuda.CUDAGraph | graph_if.GuardedGraph"
    host_state: torch.Tensor | None  # pinned (pending token, its slot), copied in by the graph; None: continuing
    host_out: torch.Tensor  # pinned: the steps' outputs packed (DeviceLoop._steps)
    done: "torch.cuda.Event"


@dataclass
class Chunk:
    """A launched chunk of steps: its graph (None: ran eagerly, `eager` holds its packed outputs)."""
    steps: int
    nodes: int  # the shape it ran: its draft nodes, its deepest path, whether a chain
    max_depth: int
    chain: bool = False
    graph: LoopGraph | None = None
    eager: torch.Tensor | None = None

    @property
    def depth_rows(self) -> int:
        """A step's most committed tokens: the root and the deepest path (DeviceLoop.depth_rows of its shape)."""
        return self.max_depth + 1


class DeviceLoop:
    """tree: the TreeShape (budget, width) of a static tree to calibrate, or with per_step of the tree grown every
    step from that step's candidates; None: a chain of the drafter's depth. spine: the calibrated tree starts with
    the full-depth rank-0 path (as far as the budget goes), for drafters whose rank 0 is prompt lookup's match where
    it has one: a match runs long or not at all, which its mean probability per depth understates (a grown tree
    needs no such help: the match's probability is 1 at every depth it covers). overlap: stream() queues each next
    chunk before reading the current one. observe_overlap: a tree step's drafter observes every tree row beside the
    target's layers after the last captured one, and the move places its accepted rows; lookup_overlap: prompt
    lookup beside the block's draft, its gate applied by the grow launch (both on a second stream:
    engines.side_stream)."""

    def __init__(self, runner: ModelRunner, drafter: DeviceDrafter, max_steps: int, tree: TreeShape | None = None,
                 spine: bool = False, overlap: bool = False, per_step: bool = False, budgets: tuple[int, ...] = (),
                 observe_overlap: bool = False, lookup_overlap: bool = False, chains: tuple[int, ...] = ()):
        if drafter.needs_features and not runner.capture:
            raise ValueError("this drafter reads target features: the runner must capture them")
        self.runner, self.drafter, self.max_steps, self.tree_shape = runner, drafter, max_steps, tree
        self.spine, self.overlap, self.per_step = spine, overlap, per_step and tree is not None
        # (pending token, its slot == position), then the stop rule's ctl (tokens left, steps run, live): one copy
        # from the host starts a chunk.
        self.loop_state = torch.zeros(5, dtype=torch.long, device=runner.device)
        self.state, self.ctl = self.loop_state[:2], self.loop_state[2:]
        self.stop: LoopStop | None = None
        self.use_graphs = runner.use_graphs and drafter.use_graph
        # tree steps' observe beside the target's last layers, the lookup beside the block's draft
        # (EngineConfig.observe_overlap, lookup_overlap; in stream order off CUDA)
        if observe_overlap and not (tree is not None and drafter.cache is not None):
            raise ValueError("observe_overlap observes every tree row beside the target's last layers: it needs a "
                             "tree and a drafter with a cache that the move places")
        if lookup_overlap and not (per_step and tree is not None and hasattr(drafter, "side")):
            raise ValueError("lookup_overlap runs the lookup beside the block's draft and gates it in the grow launch: "
                             "it needs a lookup-led block drafter's tree grown per step")
        self.side = SideStream(runner.device) if observe_overlap or lookup_overlap else None
        self.observe = self.side if observe_overlap else None
        if lookup_overlap:
            drafter.side = self.side
        self._graphs: dict[tuple[int, int, int], LoopGraph] = {}  # (steps, origin, grown tree budget or 0)
        # grown trees: budget -> (block, max depth); more than one with switched budgets (engine.StepBudgets), some
        # of them chains (EngineConfig.deep_tree_chain: a static chain block, no grow launch)
        self._grown: dict[int, tuple[TreeBlock, int]] = {}
        self._chains = frozenset(chains)
        self._slots: dict[int, torch.Tensor] = {}  # block width -> its slot offsets 0..width-1 (see _use)
        self.budget = 0  # the grown tree's budget the next chunk runs (0: a static tree or chain)
        self.tree: StaticTree | None = None
        self._prob_sum, self._calibrated_steps = 0.0, 0
        if chains and not set(chains) <= set(budgets):
            raise ValueError(f"chain budgets {chains} must be among the switched budgets {budgets}")
        if self.per_step:
            self._grow_per_step(tree, budgets)
        elif budgets:
            raise ValueError("switched tree budgets need trees grown per step")
        elif tree is not None:
            self._check(tree.budget + 1)
        else:
            self._set_tree(StaticTree.chain(drafter.depth))

    def stop_on(self, eos: frozenset[int]) -> None:
        """Track the engine's stop rule (EnginePolicy.commit's: an EOS token, the token limit) on the device, so that
        a chunk queued behind a stop is skipped. Only for that rule: what the device skips, the host must drop."""
        ids = sorted(eos) or [-1]  # -1 matches no token
        self.stop = LoopStop(torch.tensor(ids, dtype=torch.long, device=self.runner.device), self.ctl)
        self._graphs.clear()

    @property
    def ready(self) -> bool:
        """False while a tree drafter's static shape is still being calibrated (the host loop runs meanwhile)."""
        return self.tree is not None or self.per_step

    def calibrate(self, topk_probs: list[list[float]]) -> None:
        """One host-loop tree step's per-depth candidate probabilities; the CALIBRATION_STEPS-th fixes the shape.
        Steps drafted shallower (few tokens left) are skipped: their missing depths are no evidence."""
        if len(topk_probs) < self.drafter.depth:
            return
        probs = np.zeros((self.drafter.depth, self.drafter.topk))
        for d, p in enumerate(topk_probs[:len(probs)]):
            probs[d, :len(p)] = p
        self._prob_sum = self._prob_sum + probs
        self._calibrated_steps += 1
        if self._calibrated_steps >= CALIBRATION_STEPS and self.tree is None:
            s, mean = self.tree_shape, self._prob_sum / self._calibrated_steps
            if self.spine:
                mean[:, 0] = 1.0  # best first: the rank-0 path before any sibling
            self._set_tree(StaticTree.calibrated(mean, s.budget, s.width))

    def fits(self, base: int, steps: int) -> bool:
        """Whether `steps` steps from slot `base` stay inside the target's view and the drafter's cache (each step
        advances at most depth + 1 slots and writes a block past its base)."""
        rows, width = self._extent()
        last = base + (steps - 1) * rows
        return last + self.runner.block_width <= self.runner.view_slots and last + width <= self.drafter.capacity

    def chunk_steps(self, remaining: int) -> int:
        """Steps of a chunk with at most `remaining` tokens left: each step commits >= 1 token, so k <= remaining
        never runs a step whose tokens all fall past the limit. A power of two: few graphs."""
        return 1 << (min(self.max_steps, remaining).bit_length() - 1)

    @torch.no_grad()
    def run(self, seq: list[int], steps: int, remaining: int | None = None) -> LoopSteps:
        """`steps` speculative steps from seq's last token (pending, at slot len(seq) - 1), with at most `remaining`
        tokens left (None: no limit); a block drafter must have observed every position before it, and has observed
        every committed one of these steps afterwards."""
        base, t0 = len(seq) - 1, time.perf_counter()
        self._check_fits(base, steps)
        return self._collect(self._launch(seq, steps, remaining=remaining), base, t0)

    @torch.no_grad()
    def stream(self, seq: list[int], remaining: int, budget_of: Callable[[int], int] | None = None
               ) -> Iterator[LoopSteps]:
        """Chunks of steps from seq's last token while at most `remaining` tokens are left, as run() gives them.
        The caller commits each chunk's tokens to seq before taking the next and closes the stream at a stop
        (contextlib.closing). Without overlap: one chunk. With it, each next chunk is queued before the current one
        is read, from an upper bound of where the current one ends; a closed stream waits for the chunk queued
        behind (its steps are dropped: the stop's cost). budget_of(i): the grown tree budget of the stream's i-th
        chunk, asked when it is queued (one of the loop's budgets; None: the current one)."""
        base = len(seq) - 1
        steps = self.chunk_steps(remaining)
        self._check_fits(base, steps)
        if self.overlap:
            self.capture_all()  # between chunks the device is busy: no capture may run there
        t0 = time.perf_counter()
        if budget_of is not None:
            self.use_budget(budget_of(0))
        pending = self._launch(seq, steps, remaining=remaining)
        queued_steps, upper, parity, queued, chunks = steps, base, 0, None, 1
        ran = 0  # steps run since the chunk from the host (the device's count is cumulative)
        try:
            while True:
                upper += pending.steps * pending.depth_rows  # where `pending` ends at the most
                left = remaining - queued_steps  # each queued step commits >= 1 token
                queued = None
                if self.overlap and left > 1 and self.fits(upper, self.chunk_steps(left)):
                    if budget_of is not None:
                        self.use_budget(budget_of(chunks))
                    queued = self._launch(None, self.chunk_steps(left), CONTINUING[parity])
                    chunks += 1
                    queued_steps, parity = queued_steps + queued.steps, 1 - parity
                res = self._collect(pending, base, t0, ran)
                t0 = time.perf_counter()
                ran += len(res.accepted)
                base += int(res.accepted.sum()) + len(res.accepted)
                yield res
                if queued is None:
                    return
                pending, queued = queued, None
        finally:
            if queued is not None:  # closed at a stop: the chunk behind it still runs; its results are dropped
                self._wait(queued)

    @torch.no_grad()
    def capture_all(self) -> int:
        """Captures the graph of every power-of-two step count up to max_steps (between requests), in each origin
        the loop launches."""
        if not self.use_graphs or not self.ready:
            return 0
        origins = (FROM_HOST, *CONTINUING) if self.overlap else (FROM_HOST,)
        current, todo = self.budget, 0
        for budget in sorted(self._grown) or [self.budget]:
            self.use_budget(budget)
            for k, o in [(k, o) for k in (1 << i for i in range(self.max_steps.bit_length())) if k <= self.max_steps
                         for o in origins if (k, o, budget) not in self._graphs]:
                self._capture(k, o)
                todo += 1
        self.use_budget(current)
        return todo

    def use_budget(self, budget: int) -> None:
        """The grown tree budget (one the loop was built with) the next launched chunk verifies."""
        if budget != self.budget:
            if budget not in self._grown:
                raise ValueError(f"device loop: no grown tree of {budget} nodes (it has {sorted(self._grown)})")
            self._use(self._grown[budget][0], budget in self._chains, self._grown[budget][1])
            self.budget = budget

    # ---- internals ------------------------------------------------------------------------------------
    def _check_fits(self, base: int, steps: int) -> None:
        if not self.ready or not 1 <= steps <= self.max_steps or not self.fits(base, steps):
            raise ValueError(f"device loop: {steps} steps from slot {base} do not fit (ready {self.ready}, max "
                             f"{self.max_steps} steps, view {self.runner.view_slots}, drafter cache "
                             f"{self.drafter.capacity})")

    def _launch(self, seq: list[int] | None, steps: int, origin: int = FROM_HOST,
                remaining: int | None = None) -> Chunk:
        """Queues `steps` steps: FROM_HOST from seq's last token with at most `remaining` tokens left (None: no
        limit; the drafter catches up on seq first), a CONTINUING origin from the device's state (seq None)."""
        if origin == FROM_HOST:
            base, pending = len(seq) - 1, seq[-1]
            start = [pending, base, NO_LIMIT if remaining is None else remaining, 0, 1]  # loop_state, live
            self.drafter.begin(seq, base)
        if not self.use_graphs:
            if origin == FROM_HOST:
                self.loop_state.copy_(torch.tensor(start))
            return Chunk(steps, *self._shape, eager=self._steps(steps))
        g = self._graphs.get((steps, origin, self.budget)) or self._capture(steps, origin)
        if origin == FROM_HOST:
            g.done.synchronize()  # the previous replay has read host_state
            g.host_state.numpy()[:] = start
        g.graph.replay()
        g.done.record()
        return Chunk(steps, *self._shape, graph=g)

    def _wait(self, chunk: Chunk) -> None:
        if chunk.graph is not None:
            chunk.graph.done.synchronize()

    def _collect(self, chunk: Chunk, base: int, t0: float, ran_before: int = 0) -> LoopSteps:
        """The chunk's results (its one host sync), cut after the stop the device saw (with stop_on; ran_before:
        steps run since the last chunk from the host); the drafter's pending token now sits past its commits."""
        self._wait(chunk)
        if chunk.graph is not None:
            packed = chunk.graph.host_out.numpy().copy()
        else:
            packed = chunk.eager.cpu().numpy().copy()
        out, ctl = self._unpack(packed, chunk.steps, chunk.depth_rows)
        stopped = False
        if self.stop is not None:
            ran = int(ctl[1]) - ran_before
            out, stopped = [a[:ran] for a in out], not ctl[2]
        res = LoopSteps(*out, seconds=time.perf_counter() - t0, stopped=stopped, nodes=chunk.nodes,
                        max_depth=chunk.max_depth, chain=chunk.chain)
        self.drafter.end(base + int(res.accepted.sum()) + len(res.accepted))
        return res

    def _check(self, rows: int) -> int:
        """The verify width of a `rows`-row block, which must be one forward at this runner's tile."""
        r = self.runner
        lay = verify_layout(rows, np.tril(np.ones((rows, rows), dtype=bool)), range(rows), r.tile, r.block_width)
        if lay.padded != lay.width:
            raise ValueError(f"a {rows}-row block takes {lay.padded // lay.width} forwards at this runner's tile "
                             f"({lay.width}): the device loop needs one")
        return lay.width

    def _set_tree(self, tree: StaticTree) -> None:
        lay = tree.layout
        self._use(self._static_block(tree, self._block_slots), lay.chain, lay.max_depth)
        self._graphs.clear()
        self.tree = tree

    def _static_block(self, tree: StaticTree, block_slots: bool) -> TreeBlock:
        """A static tree's block (rank r of depth d: the drafter's candidate d * K + r)."""
        lay, r = tree.layout, self.runner
        rows = len(lay.parents)
        self._check(rows)
        v = verify_layout(rows, lay.anc, lay.depths, r.tile, r.block_width)
        if lay.chain and list(v.positions[:rows]) != list(range(rows)):
            raise RuntimeError("a chain's rows sit at positions base, base + 1, ..: its commit relies on it")
        node_src = (np.asarray(lay.depths[1:]) - 1) * self.drafter.topk + np.asarray(tree.ranks)  # flat top-k index
        return TreeBlock.build(node_src, lay.parents, lay.depths, lay.anc, v.width, block_slots, r.device)

    def _grow_per_step(self, shape: TreeShape, budgets: tuple[int, ...] = ()) -> None:
        """Trees grown every step from the step's own candidates (tree_grow): the deepest a path can reach is the
        drafter's depth or the budget. budgets: other budgets a chunk may verify instead (use_budget)."""
        every = (shape.budget, *budgets)
        if (shape.width > self.drafter.topk or len(set(every)) < len(every)
                or not all(1 <= b <= MAX_GROWN_NODES or b in self._chains for b in every)):
            raise ValueError(f"a grown tree takes at most {self.drafter.topk} candidates a depth and "
                             f"{MAX_GROWN_NODES} nodes, got width {shape.width}, budgets {every} (distinct)")
        for budget in every:
            if budget in self._chains:
                self._grown[budget] = self._chain_block(budget), budget
                continue
            block = TreeBlock.dead(budget, self._check(budget + 1), self._block_slots, self.runner.device)
            self._grown[budget] = block, min(self.drafter.depth, budget)
        self.use_budget(shape.budget)

    def _chain_block(self, nodes: int) -> TreeBlock:
        """A chain of `nodes` rank-0 candidates (the lookup's match where it leads): row i at depth i, slot base + i,
        so its attention reads keys in slot order, which is position order (no block slots)."""
        if nodes > self.drafter.depth:
            raise ValueError(f"a chain of {nodes} nodes: the drafter drafts {self.drafter.depth} depths")
        return self._static_block(StaticTree.chain(nodes), False)

    @property
    def _block_slots(self) -> bool:
        """Position-ordered attention reads its block slots as base + a per-(row, depth) offset that the assemble
        launch adds, instead of the runner deriving them from the mask every step."""
        return self.runner.fused is not None and self.runner.cfg.position_ordered_attention

    def _use(self, block: TreeBlock, chain: bool, max_depth: int) -> None:
        d = self.runner.device
        self.block, self.chain, self.width = block, chain, block.positions.shape[0]
        self.max_depth = max_depth
        self.depth_rows = max_depth + 1  # root + the deepest path: a step's most committed tokens
        # One slots tensor a width, kept for good: captured graphs read it by address, so switching grown trees
        # (use_budget) must not free the one an earlier budget's graphs read (its memory would be reused).
        if self.width not in self._slots:
            self._slots[self.width] = torch.arange(self.width, device=d)
        self.slots = self._slots[self.width]

    @property
    def _shape(self) -> tuple[int, int, bool]:
        """(draft nodes, max_depth, chain) of the shape the next chunk runs: a Chunk's."""
        return self.block.rows - 1, self.max_depth, self.chain

    def _extent(self) -> tuple[int, int]:
        """(most tokens a step commits, block width) over every shape a chunk may run."""
        shapes = [(d + 1, b.positions.shape[0]) for b, d in self._grown.values()] or [(self.depth_rows, self.width)]
        return max(r for r, _ in shapes), max(w for _, w in shapes)

    def _steps(self, steps: int) -> torch.Tensor:
        """`steps` steps from self.state, all on the device -> their outputs and ctl packed as int32 words in one
        tensor (one copy to the host a chunk: on the H200 each copy or stack costs ~1.5 us of a ~0.87 ms step,
        and a chunk had eleven); _unpack reads them."""
        if self.runner.device.type == "cuda":
            glue = Glue(grow_tree, assemble, chain_commit, tree_commit, tree_move)
        else:  # CPU: the glue's torch references (the interpreted kernels are slow; tests run them directly)
            glue = Glue(grow_tree_ref, assemble_ref, chain_commit_ref, tree_commit_ref, tree_move_ref)
        try:
            outs = [self._step(glue) for _ in range(steps)]
        finally:  # the side stream joined before the outputs (and the capture) end, even on an error
            if self.side is not None:
                self.side.join()
        path_tokens, accepted, proposed, top_tokens, top_probs = zip(*outs)
        words = [t.to(torch.int64).reshape(-1).view(torch.int32)  # no-ops: they are int64 already
                 for t in (*path_tokens, *accepted, *proposed, *top_tokens, self.ctl)]
        return torch.cat(words + [t.to(torch.float32).reshape(-1).view(torch.int32) for t in top_probs])

    def _packing(self, steps: int, depth_rows: int | None = None) -> list[tuple[tuple[int, ...], type, int]]:
        """(shape, dtype, int32 words) of each packed column, in _steps' order (depth_rows: the chunk's shape's;
        the candidates of its depths: max_depth = depth_rows - 1)."""
        depth_rows = depth_rows or self.depth_rows
        depth, topk = depth_rows - 1, self.drafter.topk
        cols = [((steps, depth_rows), np.int64), ((steps,), np.int64), ((steps,), np.int64),
                ((steps, depth, topk), np.int64), ((3,), np.int64), ((steps, depth, topk), np.float32)]
        return [(shape, dt, int(np.prod(shape)) * np.dtype(dt).itemsize // 4) for shape, dt in cols]

    def _unpack(self, packed: np.ndarray, steps: int, depth_rows: int) -> tuple[list[np.ndarray], np.ndarray]:
        """_steps' int32 words -> (path tokens, accepted, proposed, top-k tokens, top-k probs), ctl."""
        cols, at = [], 0
        for shape, dtype, words in self._packing(steps, depth_rows):
            cols.append(packed[at:at + words].view(dtype).reshape(shape))
            at += words
        if at != packed.shape[0]:
            raise RuntimeError(f"device loop: {packed.shape[0]} packed words, the layout reads {at}")
        *ints, ctl, probs = cols
        return [*ints, probs], ctl

    def _step(self, glue: Glue):
        """One step from self.state -> its outputs (see _steps)."""
        base = self.state[1]  # a view: read it before the state moves on
        drafter, b, observe = self.drafter, self.block, self.observe
        d = drafter.draft(self.state)
        # The shape's depths only: a 16-row tree beside a 128-row one (deep_tree_budget) grows and assembles over
        # its 15 depths, not the lookup's 127 (session 47: 9 us a narrow step on the H100)
        md = self.max_depth
        tokens, probs, lead = d.tokens[:md], d.probs[:md], None if d.lead is None else d.lead[:md]
        proposed = d.proposed
        if self.per_step and not self.chain:  # (with the lookup beside the draft, its gate: lead_depths gated in place)
            glue.grow(tokens, probs, lead, d.lead_depths, self.tree_shape.width, b, drafter.ranked_depth, d.gate)
        elif self.per_step:  # a switched chain (deep_tree_chain): the gate here, its drafted depths the lookup's too
            if d.gate is not None:
                d.gate.gate_on_device(d.lead_depths, lead[0], tokens[0], probs[0])
            if lead is not None:
                proposed = torch.clamp(torch.maximum(d.proposed, d.lead_depths.reshape(())), max=md)
        top_tokens, top_probs, ids, positions, slots, block_slots = glue.assemble(
            tokens, probs, lead, d.lead_depths, self.state, b.node_src, b.positions, self.slots, b.block_slots)
        early = {}
        if observe is not None and not self.chain:
            def observe_rows(features):  # every tree row at its tree slot and position, on the second stream
                with observe.fork(features, positions, slots):
                    drafter.commit(feature_rows(features[:, :b.rows]), slots[:b.rows], positions[:b.rows])
            early = {"on_features": observe_rows}
        target = self.runner._step_fn(ids, positions, slots, base, b.anc, block_slots, in_order=self.chain, **early)
        argmax, features = target[0][:b.rows], target[4]
        if self.chain:  # the accepted path is the block's prefix: its keys/values already sit at base..
            path_tokens, accepted = glue.chain_commit(argmax, ids, proposed, self.state, drafter.sequence,
                                                 self.stop)
            drafter.commit(None if features is None else feature_rows(features[:, :b.rows]), positions[:b.rows])
        else:
            path, path_tokens, accepted, next_state = glue.tree_commit(
                argmax, ids, b.parents, b.tree_anc, b.depths, self.state, self.depth_rows,
                drafter.sequence, self.stop)
            # the path's keys/values to slots base.. (entries past `accepted`: the root's), state <- next_state
            if observe is None:
                path_features = glue.tree_move(self.runner.kv, path, accepted, next_state, self.state, features)
                drafter.commit(path_features, slots[:self.depth_rows])  # slots: base + 0, 1, ..
            else:  # the drafter observed every row already: its path rows move with the target's
                observe.join()
                glue.tree_move(self.runner.kv, path, accepted, next_state, self.state, None, drafter.cache)
        return path_tokens, accepted, proposed.reshape(()), top_tokens, top_probs

    def _capture(self, steps: int, origin: int = FROM_HOST) -> LoopGraph:
        """One graph of `steps` steps. Warm-up and capture run real steps from slot 0: the target's first slots
        (graphs.capture_restoring), the drafter's state and the loop's are restored afterwards (a capture
        mid-request must not clobber its context)."""
        buffers = self.drafter.buffers() + [self.loop_state]
        saved = [b.clone() for b in buffers]
        # token 0 at slot 0 while capturing, live, no limit (continuing graphs: where their warm-ups start)
        host_state = torch.tensor([0, 0, NO_LIMIT, 0, 1]).pin_memory()
        host_out = torch.zeros(sum(words for *_, words in self._packing(steps)), dtype=torch.int32).pin_memory()

        def body():
            if origin == FROM_HOST:
                self.loop_state.copy_(host_state, non_blocking=True)
            elif not torch.cuda.is_current_stream_capturing():  # each warm-up from slot 0 (scratch), not the graph
                self.loop_state.copy_(host_state)
            host_out.copy_(self._steps(steps), non_blocking=True)
        # A continuing chunk may be queued behind a stop: with the stop rule, it runs only while the request is live.
        guard = origin != FROM_HOST and self.stop is not None
        why_not = graph_if.unsupported_reason() if guard else None
        if why_not is not None:
            log.warning("device loop: a chunk queued behind a stop runs in full here (%s)", why_not)
            guard = False
        graph, _ = capture_restoring(self.runner, body, steps * self.depth_rows + self.runner.block_width,
                                     keep_graph=guard)
        if guard:
            graph = graph_if.GuardedGraph(graph, self.ctl[2:])
        for b, copy in zip(buffers, saved):
            b.copy_(copy)
        g = self._graphs[steps, origin, self.budget] = LoopGraph(graph, host_state if origin == FROM_HOST else None, host_out,
                                                    torch.cuda.Event())
        g.done.record()
        return g
