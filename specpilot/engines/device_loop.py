"""Speculative steps with no host round trip between them: k steps per sync, chain or static tree, with a drafter
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

Chains have that shape by construction. A tree's shape is the best-first tree of the drafter's *mean* top-k
probabilities per depth and rank (`StaticTree.calibrated`), measured over the engine's first host-loop tree steps:
the per-step dynamic tree tracks each step's probabilities, the static one costs no host work.

Exactness is the host loop's: every verify is the runner's step function on the same layouts. What differs is
drafter state only (rows past the accepted path are projected too, at positions no draft reads before they are
rewritten), so proposals may differ in low bits; verification decides either way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from specpilot.costmodel.acceptance import best_first_tree
from specpilot.engines.device_drafters import DeviceDrafter
from specpilot.engines.drafters.block_tree import TreeShape
from specpilot.engines.graphs import capture_restoring
from specpilot.engines.layout import DraftLayout, draft_layout, verify_layout
from specpilot.engines.llama import ancestor_slots
from specpilot.engines.loop_kernels import (assemble, assemble_ref, chain_commit, chain_commit_ref, tree_commit,
                                            tree_commit_ref)
from specpilot.engines.runner import ModelRunner

# Host-loop tree steps whose drafter probabilities fix a static tree's shape.
CALIBRATION_STEPS = 16


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
    topk_tokens: np.ndarray  # [k, depth, K] the drafter's candidates per depth (traces: exact replay)
    topk_probs: np.ndarray
    seconds: float  # wall time of the k steps, host round trip included


@dataclass
class LoopGraph:
    graph: "torch.cuda.CUDAGraph"
    host_state: torch.Tensor  # pinned (pending token, its slot): copied in by the graph
    host_out: tuple[torch.Tensor, ...]  # pinned path tokens, accepted, proposed, top-k tokens, top-k probs
    done: "torch.cuda.Event"


class DeviceLoop:
    """tree: the TreeShape (budget, width) of a static tree to calibrate; None: a chain of the drafter's depth.
    spine: the calibrated tree starts with the full-depth rank-0 path (as far as the budget goes), for drafters
    whose rank 0 is prompt lookup's match where it has one: a match runs long or not at all, which its mean
    probability per depth understates."""

    def __init__(self, runner: ModelRunner, drafter: DeviceDrafter, max_steps: int, tree: TreeShape | None = None,
                 spine: bool = False):
        if drafter.needs_features and not runner.capture:
            raise ValueError("this drafter reads target features: the runner must capture them")
        self.runner, self.drafter, self.max_steps, self.tree_shape = runner, drafter, max_steps, tree
        self.spine = spine
        self.state = torch.zeros(2, dtype=torch.long, device=runner.device)  # (pending token, its slot == position)
        self.use_graphs = runner.use_graphs and drafter.use_graph
        self._graphs: dict[int, LoopGraph] = {}
        self.tree: StaticTree | None = None
        self._prob_sum, self._calibrated_steps = 0.0, 0
        if tree is not None:
            self._check(tree.budget + 1)
        else:
            self._set_tree(StaticTree.chain(drafter.depth))

    @property
    def ready(self) -> bool:
        """False while a tree drafter's static shape is still being calibrated (the host loop runs meanwhile)."""
        return self.tree is not None

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
        last = base + (steps - 1) * self.depth_rows
        return last + self.runner.block_width <= self.runner.view_slots and last + self.width <= self.drafter.capacity

    @torch.no_grad()
    def run(self, seq: list[int], steps: int) -> LoopSteps:
        """`steps` speculative steps from seq's last token (pending, at slot len(seq) - 1); a block drafter must have
        observed every position before it, and has observed every committed one of these steps afterwards."""
        base, pending = len(seq) - 1, seq[-1]
        if not self.ready or not 1 <= steps <= self.max_steps or not self.fits(base, steps):
            raise ValueError(f"device loop: {steps} steps from slot {base} do not fit (ready {self.ready}, max "
                             f"{self.max_steps} steps, view {self.runner.view_slots}, drafter cache "
                             f"{self.drafter.capacity})")
        self.drafter.begin(seq, base)
        t0 = time.perf_counter()
        if self.use_graphs:
            g = self._graphs.get(steps) or self._capture(steps)
            g.done.synchronize()  # the previous replay has read host_state
            g.host_state.numpy()[:] = pending, base
            g.graph.replay()
            g.done.record()
            g.done.synchronize()  # the chunk's one host sync
            out = [t.numpy().copy() for t in g.host_out]
        else:
            self.state.copy_(torch.tensor([pending, base]))
            out = [t.cpu().numpy() for t in self._steps(steps)]
        res = LoopSteps(*out, seconds=time.perf_counter() - t0)
        self.drafter.end(base + int(res.accepted.sum()) + steps)
        return res

    @torch.no_grad()
    def capture_all(self) -> int:
        """Captures the graph of every power-of-two step count up to max_steps (between requests)."""
        if not self.use_graphs or not self.ready:
            return 0
        todo = [k for k in (1 << i for i in range(self.max_steps.bit_length())) if k <= self.max_steps
                and k not in self._graphs]
        for k in todo:
            self._capture(k)
        return len(todo)

    # ---- internals ------------------------------------------------------------------------------------
    def _check(self, rows: int):
        r = self.runner
        lay = verify_layout(rows, np.tril(np.ones((rows, rows), dtype=bool)), range(rows), r.tile, r.block_width)
        if lay.padded != lay.width:
            raise ValueError(f"a {rows}-row block takes {lay.padded // lay.width} forwards at this runner's tile "
                             f"({lay.width}): the device loop needs one")

    def _set_tree(self, tree: StaticTree) -> None:
        lay, d, r = tree.layout, self.runner.device, self.runner
        rows = len(lay.parents)
        self._check(rows)
        v = verify_layout(rows, lay.anc, lay.depths, r.tile, r.block_width)
        self.tree, self.chain, self.width = tree, lay.chain, v.width
        self.max_depth = lay.max_depth
        self.depth_rows = self.max_depth + 1  # root + the deepest path: a step's most committed tokens
        as_long = lambda a: torch.tensor(np.asarray(a), dtype=torch.long, device=d)  # noqa: E731
        depths = np.asarray(lay.depths)
        self.node_src = as_long((depths[1:] - 1) * self.drafter.topk + np.asarray(tree.ranks))  # flat top-k index
        self.parents = as_long(lay.parents)
        self.positions, self.slots = as_long(v.positions), as_long(v.slots)
        anc = torch.from_numpy(np.array(v.anc[:, :v.width]))  # the runner's step reads [width, width]: no copy
        self.anc = anc.to(d)
        # Position-ordered attention's block slots are base + a static offset per (row, depth): the assemble launch
        # adds base, instead of the runner deriving them from anc every step.
        self.rel_block_slots = None
        if r.fused is not None and r.cfg.position_ordered_attention:
            self.rel_block_slots = ancestor_slots(torch.tensor(0), anc).to(d)
        self.tree_anc = torch.from_numpy(np.array(lay.anc, dtype=np.uint8)).to(d)  # ancestors-or-self [rows, rows]
        self.row_depths = as_long(depths)
        self.depth_offsets = torch.arange(self.depth_rows, device=d)
        if lay.chain and list(v.positions[:rows]) != list(range(rows)):
            raise RuntimeError("a chain's rows sit at positions base, base + 1, ..: its commit relies on it")
        self._graphs.clear()

    def _steps(self, steps: int) -> tuple[torch.Tensor, ...]:
        """`steps` steps from self.state, all on the device -> path tokens, accepted, proposed, top-k tokens/probs."""
        drafter, rows = self.drafter, len(self.row_depths)
        if self.runner.device.type == "cuda":
            assemble_block, commit_chain, commit_tree = assemble, chain_commit, tree_commit
        else:  # CPU: the glue's torch references (the interpreted kernels are slow; tests run them directly)
            assemble_block, commit_chain, commit_tree = assemble_ref, chain_commit_ref, tree_commit_ref
        outs = []
        for _ in range(steps):
            base = self.state[1]  # a view: read it before the state moves on
            d = drafter.draft(self.state)
            top_tokens, top_probs, ids, positions, slots, block_slots = assemble_block(
                d.tokens, d.probs, d.lead, d.lead_depths, self.state, self.node_src, self.positions, self.slots,
                self.rel_block_slots)
            target = self.runner._step_fn(ids, positions, slots, base, self.anc, block_slots)
            argmax, features = target[0][:rows], target[4]
            if self.chain:  # the accepted path is the block's prefix: its keys/values already sit at base..
                path_tokens, accepted = commit_chain(argmax, ids, d.proposed, self.state, drafter.sequence)
                drafter.commit(None if features is None else features[:rows], positions[:rows])
            else:
                path, path_tokens, accepted, next_state = commit_tree(
                    argmax, ids, self.parents, self.tree_anc, self.row_depths, self.state, self.depth_rows,
                    drafter.sequence)
                kv = self.runner.kv  # the path's keys/values to slots base.. (entries past `accepted`: the root's)
                kv[:, :, :, base + self.depth_offsets] = kv[:, :, :, base + path]
                drafter.commit(None if features is None else features[path], base + self.depth_offsets)
                self.state.copy_(next_state)
            outs.append((path_tokens, accepted, d.proposed.reshape(()), top_tokens, top_probs))
        return tuple(torch.stack(col) for col in zip(*outs))

    def _capture(self, steps: int) -> LoopGraph:
        """One graph of `steps` steps. Warm-up and capture run real steps from slot 0: the target's first slots
        (graphs.capture_restoring) and the drafter's state are restored afterwards (a capture mid-request must not
        clobber its context)."""
        buffers = self.drafter.buffers()
        saved = [b.clone() for b in buffers]
        host_state = torch.zeros(2, dtype=torch.long).pin_memory()  # token 0 at slot 0 while capturing
        k, depth, topk = steps, self.drafter.depth, self.drafter.topk
        host_out = (torch.zeros(k, self.depth_rows, dtype=torch.long).pin_memory(),
                    torch.zeros(k, dtype=torch.long).pin_memory(), torch.zeros(k, dtype=torch.long).pin_memory(),
                    torch.zeros(k, depth, topk, dtype=torch.long).pin_memory(),
                    torch.zeros(k, depth, topk, dtype=torch.float32).pin_memory())

        def body():
            self.state.copy_(host_state, non_blocking=True)
            for host, dev in zip(host_out, self._steps(steps)):
                host.copy_(dev, non_blocking=True)
        graph, _ = capture_restoring(self.runner, body, steps * self.depth_rows + self.runner.block_width)
        for b, copy in zip(buffers, saved):
            b.copy_(copy)
        g = self._graphs[steps] = LoopGraph(graph, host_state, host_out, torch.cuda.Event())
        g.done.record()
        return g
