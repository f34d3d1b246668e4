"""Speculative steps with no host round trip between them: block drafter, chain verification, k steps a sync.

The host loop (SpecEngine.generate) syncs twice a step, to read the draft and the verify's argmax, and the GPU
idles while the host builds the next step (on the H200 ~0.35 ms of a ~1.8 ms chain step went to such gaps). A
chain step's whole dependency fits on the device: the draft's top-1 tokens are the block, the verify's argmax
decides acceptance (accepted = length of the prefix where draft == argmax), the committed tokens are the argmax
rows 0..accepted (an accepted draft token equals the argmax before it), the bonus token is the next step's
pending token and base + accepted + 1 its slot. So k steps run as one CUDA graph replay; the host reads their
tokens once, cuts them at EOS / the token limit and discards the rest (steps past a stop only cost time).

Exactness is the host loop's: every verify is the same forward (the runner's step function, the same layout).
What differs is drafter state only: the drafter projects the features of all block rows (rejected rows land past
the pending position, where no draft reads them before an observe or a draft overwrites them), so its proposals
may differ from the host loop's in low bits; verification decides either way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from specpilot.engines.drafters.block_tree import BlockTreeDrafter
from specpilot.engines.layout import verify_layout
from specpilot.engines.runner import ModelRunner, chain_anc
from specpilot.kernels._common import capture_graph


@dataclass
class LoopSteps:
    """Host copies of k device steps' results."""
    block_tokens: np.ndarray  # [k, depth + 1] the target's argmax after each block row
    accepted: np.ndarray  # [k] draft tokens accepted per step: commit block_tokens[i, :accepted[i] + 1]
    topk_tokens: np.ndarray  # [k, depth, K] the drafter's candidates per depth (traces: exact replay)
    topk_probs: np.ndarray
    seconds: float  # wall time of the k steps, host round trip included


@dataclass
class LoopGraph:
    graph: "torch.cuda.CUDAGraph"
    host_state: torch.Tensor  # pinned (pending token, its slot): copied in by the graph
    host_out: tuple[torch.Tensor, ...]  # pinned block tokens, accepted, top-k tokens, top-k probs
    done: "torch.cuda.Event"


class DeviceChainLoop:
    def __init__(self, runner: ModelRunner, drafter: BlockTreeDrafter, max_steps: int):
        if drafter.shape.tree:
            raise ValueError("the device loop runs chain verification only (the drafter grows trees)")
        if not runner.capture:
            raise ValueError("the device loop needs a runner that captures the block drafter's target features")
        self.runner, self.drafter, self.max_steps = runner, drafter, max_steps
        self.depth = drafter.shape.depth
        self.rows = self.depth + 1  # root + chain
        lay = verify_layout(self.rows, chain_anc(self.rows), range(self.rows), runner.tile, runner.block_width)
        if lay.padded != lay.width:
            raise ValueError(f"a {self.rows}-token chain takes {lay.padded // lay.width} forwards at this runner's "
                             f"tile ({lay.width}): the device loop needs one")
        d = runner.device
        # A chain's rows and the pad rows all sit at slot == position == base + row (verify_layout's layout).
        self.offsets = torch.arange(lay.width, device=d)
        self.anc = torch.from_numpy(np.array(lay.anc)).to(d)
        self.pad = torch.zeros(lay.width - self.rows, dtype=torch.long, device=d)
        self.state = torch.zeros(2, dtype=torch.long, device=d)  # (pending token, its slot == position)
        self.use_graphs = runner.use_graphs and drafter.use_graph
        self._graphs: dict[int, LoopGraph] = {}

    def fits(self, base: int, steps: int) -> bool:
        """Whether `steps` steps from slot `base` stay inside the target's view and the drafter's cache (each step
        advances at most depth + 1 slots and writes a block past its base)."""
        last = base + (steps - 1) * self.rows
        return last + self.runner.block_width <= self.runner.view_slots and last + self.rows <= self.drafter.capacity

    @torch.no_grad()
    def run(self, base: int, pending: int, steps: int) -> LoopSteps:
        """`steps` speculative steps from the pending token at slot `base`; the drafter must have observed every
        position before it. Afterwards the drafter has observed every committed position of these steps."""
        if not 1 <= steps <= self.max_steps or not self.fits(base, steps):
            raise ValueError(f"device loop: {steps} steps from slot {base} do not fit (max {self.max_steps} steps, "
                             f"view {self.runner.view_slots}, drafter cache {self.drafter.capacity})")
        if self.drafter.n_ctx != base:
            raise RuntimeError(f"device loop: the drafter has features for {self.drafter.n_ctx} positions, the pending "
                               f"token sits at {base}")
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
        self.drafter.n_ctx = base + int(res.accepted.sum()) + steps
        return res

    @torch.no_grad()
    def capture_all(self) -> int:
        """Captures the graph of every power-of-two step count up to max_steps (between requests)."""
        if not self.use_graphs:
            return 0
        todo = [k for k in (1 << i for i in range(self.max_steps.bit_length())) if k <= self.max_steps
                and k not in self._graphs]
        for k in todo:
            self._capture(k)
        return len(todo)

    def _steps(self, steps: int) -> tuple[torch.Tensor, ...]:
        """`steps` chain steps from self.state, all on the device -> block tokens, accepted, top-k tokens/probs."""
        step, rows, depth = self.drafter.step, self.rows, self.depth
        outs = []
        for _ in range(steps):
            pending, base = self.state[:1], self.state[1]
            top_tokens, top_probs = step.draft(self.state)
            chain = top_tokens[:depth, 0]
            pos = base + self.offsets
            target = self.runner._step_fn(torch.cat([pending, chain, self.pad]), pos, pos, base, self.anc)
            argmax = target[0][:rows]
            accepted = (chain == argmax[:depth]).long().cumprod(0).sum()
            step.project(target[4][:rows], pos[:rows])
            self.state.copy_(torch.cat([torch.index_select(argmax, 0, accepted.view(1)), (base + accepted + 1).view(1)]))
            outs.append((argmax, accepted, top_tokens[:depth], top_probs[:depth]))
        return tuple(torch.stack(col) for col in zip(*outs))

    def _capture(self, steps: int) -> LoopGraph:
        """One graph of `steps` steps. Warm-up and capture run real steps from slot 0: the target's first slots and
        the drafter's cache are restored afterwards (a capture mid-request must not clobber its context)."""
        runner, cache = self.runner, self.drafter.step.cache
        scratch = steps * self.rows + runner.block_width
        saved_kv, saved_cache = runner.kv[:, :, :, :scratch].clone(), cache.clone()
        host_state = torch.zeros(2, dtype=torch.long).pin_memory()  # token 0 at slot 0 while capturing
        k, depth, topk = steps, self.depth, self.drafter.topk
        host_out = (torch.zeros(k, self.rows, dtype=torch.long).pin_memory(), torch.zeros(k, dtype=torch.long).pin_memory(),
                    torch.zeros(k, depth, topk, dtype=torch.long).pin_memory(),
                    torch.zeros(k, depth, topk, dtype=torch.float32).pin_memory())

        def body():
            self.state.copy_(host_state, non_blocking=True)
            for host, dev in zip(host_out, self._steps(steps)):
                host.copy_(dev, non_blocking=True)
        graph, _ = capture_graph(body)
        torch.cuda.synchronize(runner.device)
        runner.kv[:, :, :, :scratch] = saved_kv
        cache.copy_(saved_cache)
        g = self._graphs[steps] = LoopGraph(graph, host_state, host_out, torch.cuda.Event())
        g.done.record()
        return g
