"""The block drafter at run time: a drafter-side KV cache of projected target features, one forward over the
B block slots per step, and a chain (top-1 path) or a best-first dynamic tree from the per-position
distributions.

The engine feeds features through `observe(start, features)`: all prompt tokens after prefill, then the root
and accepted nodes after each verify (positions start, start+1, ...). Each call truncates the cache at
`start` (dropping anything a rejected path left) and appends, so the cache always holds one projected
key/value per committed token except the pending last one, which enters the block as its first slot.
With CUDA graphs both calls are replays: the draft step one graph, an observe of n <= block_size tokens one
graph per n (same shapes as the eager call, so the same kernels); longer observes (the prompt) run eagerly.
The forward itself is block_step.BlockStep.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.costmodel.acceptance import best_first_tree
from specpilot.engines.config import EngineConfig, VerifyMode
from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.drafters.block import BlockDrafterModel, drafter_head, runtime_copy
from specpilot.engines.drafters.block_fused import DraftLaunches, FusedBlockStep, fusable
from specpilot.engines.drafters.block_step import BlockStep
from specpilot.engines.llama import LlamaModel
from specpilot.kernels._common import capture_graph

# Candidates recorded per depth for the cost model's exact replay: at least this many, whatever the width.
TRACE_TOPK = 8


@dataclass(frozen=True)
class TreeShape:
    """How a block's distributions become a draft: a chain of the top-1 tokens, or a best-first tree of at most
    `budget` nodes, `width` children per node and `depth` levels (depth <= block_size - 1)."""

    tree: bool
    block_size: int  # block slots fed per forward (<= the drafter's trained block size)
    budget: int
    width: int
    depth: int

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block drafter needs at least 2 slots")
        if not 1 <= self.depth <= self.block_size - 1:
            raise ValueError(f"depth={self.depth}: must be in 1..block_size-1 ({self.block_size - 1})")
        if self.budget < 1 or self.width < 1:
            raise ValueError(f"budget={self.budget}, width={self.width}: must be >= 1")

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "TreeShape":
        """Chain verification drafts the whole block (B-1 tokens, as DFlash ships it); tree and two-level
        verification grow a tree of cfg.tree_budget nodes, cfg.tree_width children, depth B-1."""
        return cls(tree=cfg.verify is not VerifyMode.CHAIN, block_size=cfg.block_size, budget=cfg.tree_budget,
                   width=cfg.tree_width, depth=cfg.tree_depth or cfg.block_size - 1)

    @property
    def max_nodes(self) -> int:
        return self.budget if self.tree else self.depth


@dataclass
class DrafterGraph:
    """A captured drafter call: it copies its pinned host ints in (and, for the draft, its top-k out) itself."""
    graph: "torch.cuda.CUDAGraph"
    host_in: torch.Tensor  # pinned: (pending token, position) for the draft; (first position,) for observe
    staged: "torch.cuda.Event"  # recorded after each replay: the host may refill host_in once it has passed
    inputs: torch.Tensor | None = None  # observe: the static features buffer [n, feature_dim]
    host_tokens: torch.Tensor | None = None  # draft: pinned [B - 1, k]
    host_probs: torch.Tensor | None = None
    keep: tuple = ()  # device buffers the graph reads: they must live as long as it


class BlockTreeDrafter:
    def __init__(self, model: BlockDrafterModel, target: LlamaModel, shape: TreeShape, max_len: int,
                 device: str | torch.device, cuda_graphs: bool = False, fused: bool = False, window: int = 0,
                 head_rows: int = 0, launches: DraftLaunches = DraftLaunches()):
        c = model.config
        c.check_target(target.shape)
        if shape.block_size > c.block_size:
            raise ValueError(f"block_size={shape.block_size} exceeds the drafter's trained block size {c.block_size}")
        self.device = torch.device(device)
        dtype = target.embed_tokens.weight.dtype
        runtime = runtime_copy(model, self.device, dtype)
        self.shape, self.capture = shape, c.target_layers
        self.capacity = max_len
        # head_rows: the LM head restricted to the target's most generated tokens (EngineConfig.drafter_head_rows)
        head, kept = drafter_head(model, target, head_rows)
        self.topk = min(head.shape[0], max(shape.width, TRACE_TOPK))
        # fused: the engine's Triton kernels, ~20 launches a draft instead of ~108 (other low bits than the
        # trainer's reference: proposals only); drafters the kernels cannot run keep the reference step.
        # (launches: the fused step's projection settings, DraftLaunches)
        fused = fused and fusable(runtime)
        self.step = (FusedBlockStep if fused else BlockStep)(
            runtime, target.embed_tokens.weight, head, max_len, shape.block_size, self.topk, window=window,
            token_map=kept, **({"launches": launches} if fused else {}))
        self._graph: DrafterGraph | None = None
        self._observe_graphs: dict[int, DrafterGraph] = {}  # per observed count n <= block_size
        self.use_graph = cuda_graphs and self.device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.n_ctx = 0  # committed positions whose projected features sit in the cache

    @torch.no_grad()
    def observe(self, start: int, features: torch.Tensor) -> None:
        """Target features [n, feature_dim] of the tokens at positions start..start+n-1."""
        n = features.shape[0]
        if start > self.n_ctx:
            raise RuntimeError(f"block drafter: features for positions {self.n_ctx}..{start - 1} were never observed")
        if start + n > self.capacity:
            raise ValueError(f"block drafter: context of {start + n} tokens exceeds its cache ({self.capacity})")
        if self.use_graph and n <= self.shape.block_size:  # after each verify: one replay, not ~50 launches
            g = self._observe_graphs.get(n)
            if g is None:  # capture with the real inputs: warm-up and capture write exactly this call's values
                g = self._observe_graphs[n] = self._capture_observe(n, start, features)
            g.staged.synchronize()
            g.inputs.copy_(features)
            g.host_in.numpy()[0] = start  # through numpy: a tensor __setitem__ is a dispatched op (~5 us of host)
            g.graph.replay()
            g.staged.record()
        else:
            self.step.project(features.to(self.device), torch.arange(start, start + n, device=self.device))
        self.n_ctx = start + n

    @torch.no_grad()
    def distributions(self, pending: int, position: int, depth: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k tokens and probabilities for the `depth` positions after the pending token at `position`."""
        if self.n_ctx != position:
            raise RuntimeError(f"block drafter: has features for {self.n_ctx} tokens but the pending token sits at "
                               f"position {position} (the engine must call observe after prefill and each verify)")
        if self.use_graph:
            g = self._graph or self._capture_draft()
            g.host_in.numpy()[:] = pending, position  # one numpy write, not two dispatched tensor __setitem__
            g.graph.replay()
            g.staged.record()
            g.staged.synchronize()  # the step's one host sync
            tokens, probs = g.host_tokens, g.host_probs
        else:
            tokens, probs = self.step.draft(torch.tensor([pending, position], device=self.device))
        return tokens[:depth].tolist(), probs[:depth].tolist()

    @torch.no_grad()
    def capture_all(self) -> int:
        """Captures the draft graph and the observe graph of every count 1..block_size, so no capture lands in a
        timed generation. The observe captures write cache slots 0..n-1 from zero features: restored afterwards."""
        if not self.use_graph:
            return 0
        saved = self.step.cache.clone()
        todo = [n for n in range(1, self.shape.block_size + 1) if n not in self._observe_graphs]
        zeros = torch.zeros(self.shape.block_size, self.step.config.feature_dim, dtype=self.step.cache.dtype,
                            device=self.device)
        for n in todo:
            self._observe_graphs[n] = self._capture_observe(n, 0, zeros[:n])
        captured = len(todo) + (self._graph is None)
        if self._graph is None:
            self._capture_draft()
        torch.cuda.synchronize(self.device)
        self.step.cache.copy_(saved)
        return captured

    def _capture_observe(self, n: int, start: int, features: torch.Tensor) -> DrafterGraph:
        ints = torch.zeros(1, dtype=torch.long, device=self.device)
        offsets = torch.arange(n, device=self.device)
        inputs = features.to(device=self.device, dtype=self.step.cache.dtype).clone()
        host_in = torch.tensor([start], dtype=torch.long).pin_memory()

        def body():
            ints.copy_(host_in, non_blocking=True)
            self.step.project(inputs, ints + offsets)
        graph, _ = capture_graph(body)
        torch.cuda.synchronize(self.device)
        g = DrafterGraph(graph, host_in, torch.cuda.Event(), inputs=inputs, keep=(ints, offsets))
        g.staged.record()
        return g

    def _capture_draft(self) -> DrafterGraph:
        """The drafting step as one CUDA graph: it copies (pending, position) in from pinned memory and the top-k
        out to pinned memory itself. A draft writes the block's keys (the cache tail, or with Triton attention the
        slots from the pending position on); warm-up and capture run at position 0, so the cache is restored after
        them: a capture in the middle of a request (no warm_up) must not overwrite committed context."""
        saved = self.step.cache.clone()
        ints = torch.zeros(2, dtype=torch.long, device=self.device)
        host_in = torch.zeros(2, dtype=torch.long).pin_memory()
        n = self.shape.block_size - 1
        host_tokens = torch.zeros(n, self.topk, dtype=torch.long).pin_memory()
        host_probs = torch.zeros(n, self.topk, dtype=torch.float32).pin_memory()

        def body():
            ints.copy_(host_in, non_blocking=True)
            tokens, probs = self.step.draft(ints)
            host_tokens.copy_(tokens, non_blocking=True)
            host_probs.copy_(probs, non_blocking=True)
        graph, _ = capture_graph(body)
        torch.cuda.synchronize(self.device)
        self.step.cache.copy_(saved)
        self._graph = DrafterGraph(graph, host_in, torch.cuda.Event(), host_tokens=host_tokens, host_probs=host_probs,
                                keep=(ints,))
        return self._graph

    def propose(self, context: list[int], max_depth: int, budget: int | None = None, chain: bool = False
                ) -> DraftTree:
        """budget: this step's tree budget (EngineConfig.narrow_tree_budget), else the shape's; chain: a chain of
        at most `budget` nodes instead (EngineConfig.deep_tree_chain)."""
        tokens, probs = self.candidates(context, max_depth)
        return self.tree_of(tokens, probs, budget, chain) if tokens else DraftTree()

    def candidates(self, context: list[int], max_depth: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k tokens and probabilities of the depths after the context's last (pending) token."""
        depth = min(self.shape.depth, max_depth)
        return self.distributions(context[-1], len(context) - 1, depth) if depth > 0 else ([], [])

    def tree_of(self, topk_tokens: list[list[int]], topk_probs: list[list[float]], budget: int | None = None,
                chain: bool = False) -> DraftTree:
        """The draft of per-depth candidates (best first): the top-1 chain, or the best-first tree in budget (chain:
        the top-1 chain of at most `budget` nodes)."""
        if chain:
            topk_tokens, topk_probs = topk_tokens[:budget], topk_probs[:budget]
        if not self.shape.tree or chain:
            scores, p = [], 1.0
            for probs in topk_probs:
                p *= probs[0]
                scores.append(p)
            return DraftTree.chain([t[0] for t in topk_tokens], scores, topk_tokens=topk_tokens, topk_probs=topk_probs)
        w = self.shape.width  # at most `width` candidates per depth = at most `width` children per node
        tree = best_first_tree([t[:w] for t in topk_tokens], [p[:w] for p in topk_probs], budget or self.shape.budget)
        return DraftTree(list(tree.tokens), list(tree.parents), list(tree.scores), topk_tokens=topk_tokens,
                         topk_probs=topk_probs)
