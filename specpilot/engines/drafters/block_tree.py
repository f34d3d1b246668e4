"""The block drafter at run time: a drafter-side KV cache of projected target features, one forward over the
B block slots per step, and a chain (top-1 path) or a best-first dynamic tree from the per-position
distributions.

The engine feeds features through `observe(start, features)`: all prompt tokens after prefill, then the root
and accepted nodes after each verify (positions start, start+1, ...). Each call truncates the cache at
`start` (dropping anything a rejected path left) and appends, so the cache always holds one projected
key/value per committed token except the pending last one, which enters the block as its first slot.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specpilot.costmodel.acceptance import best_first_tree
from specpilot.engines.config import EngineConfig, VerifyMode
from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.drafters.block import BlockDrafterModel, lm_head_weight
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
class DraftGraph:
    graph: "torch.cuda.CUDAGraph"
    host_in: torch.Tensor  # pinned (pending token, position)
    host_tokens: torch.Tensor  # pinned [B - 1, k]
    host_probs: torch.Tensor
    done: "torch.cuda.Event"
    keep: tuple = ()  # device buffers the graph reads: they must live as long as it


class BlockTreeDrafter:
    def __init__(self, model: BlockDrafterModel, target: LlamaModel, shape: TreeShape, max_len: int,
                 device: str | torch.device, cuda_graphs: bool = False):
        c = model.config
        c.check_target(target.shape)
        if shape.block_size > c.block_size:
            raise ValueError(f"block_size={shape.block_size} exceeds the drafter's trained block size {c.block_size}")
        self.device = torch.device(device)
        dtype = target.embed_tokens.weight.dtype
        # A private copy at the target's dtype: the caller's model (a trainer's float32 one) stays untouched.
        self.model = copy.deepcopy(model).to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.model.inv_freq = self.model._inv_freq().to(self.device)  # rotary frequencies stay float32
        self.embed, self.head = target.embed_tokens.weight, lm_head_weight(target)
        self.shape, self.capture = shape, c.target_layers
        self.capacity = max_len
        # [layers, k/v, kv_heads, slots, head_dim]: projected context, rotated to each slot's position.
        self.cache = torch.zeros(c.layers, 2, c.kv_heads, max_len, c.head_dim, dtype=dtype, device=self.device)
        self.topk = min(c.vocab, max(shape.width, TRACE_TOPK))
        # Fixed shapes for every step (the whole cache, keys at or past the pending position masked): one CUDA
        # graph serves all steps, and no attention backend meets a new key length each step.
        self._key_ids = torch.arange(max_len, device=self.device)
        self._slot_ids = torch.arange(shape.block_size, device=self.device)
        self._block_ok = torch.ones(shape.block_size, shape.block_size, dtype=torch.bool, device=self.device)
        self._graph: DraftGraph | None = None
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
        pos = torch.arange(start, start + n, device=self.device)[None]
        for i, (k, v) in enumerate(self.model.context_kv(features.to(self.device)[None], pos)):
            self.cache[i, 0, :, start:start + n] = k[0]
            self.cache[i, 1, :, start:start + n] = v[0]
        self.n_ctx = start + n

    @torch.no_grad()
    def distributions(self, pending: int, position: int, depth: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k tokens and probabilities for the `depth` positions after the pending token at `position`."""
        if self.n_ctx != position:
            raise RuntimeError(f"block drafter: has features for {self.n_ctx} tokens but the pending token sits at "
                               f"position {position} (the engine must call observe after prefill and each verify)")
        if self.use_graph:
            g = self._graph or self._capture()
            g.host_in[0], g.host_in[1] = pending, position
            g.graph.replay()
            g.done.record()
            g.done.synchronize()  # the step's one host sync
            tokens, probs = g.host_tokens, g.host_probs
        else:
            tokens, probs = self._draft(torch.tensor([pending, position], device=self.device))
        return tokens[:depth].tolist(), probs[:depth].tolist()

    def _draft(self, ints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ints = (pending token, its position) on the device -> top-k tokens and probabilities [B - 1, k] of the
        block slots after the pending one. Reads the whole cache with a mask, so every step has the same shapes."""
        width = self.shape.block_size
        x = self.model.block_inputs(self.embed[ints[:1]], width)  # [1, B, H]
        pos = (ints[1] + self._slot_ids)[None]
        ctx_ok = (self._key_ids < ints[1]).expand(width, -1)
        mask = torch.cat([ctx_ok, self._block_ok], dim=1)[None]  # block slots see each other (non-causal)
        ctx = [(self.cache[i, 0, None], self.cache[i, 1, None]) for i in range(len(self.model.layers))]
        hidden = self.model(x, pos, ctx, mask)[0, 1:]
        logp = torch.log_softmax(self.model.logits(hidden, self.head).float(), dim=-1)
        top = torch.topk(logp, self.topk, dim=-1)
        return top.indices, top.values.exp()

    def _capture(self) -> "DraftGraph":
        """The drafting step as one CUDA graph: it copies (pending, position) in from pinned memory and the top-k
        out to pinned memory itself. It only reads the drafter cache, so warm-up and capture disturb nothing."""
        ints = torch.zeros(2, dtype=torch.long, device=self.device)
        host_in = torch.zeros(2, dtype=torch.long).pin_memory()
        n = self.shape.block_size - 1
        host_tokens = torch.zeros(n, self.topk, dtype=torch.long).pin_memory()
        host_probs = torch.zeros(n, self.topk, dtype=torch.float32).pin_memory()

        def body():
            ints.copy_(host_in, non_blocking=True)
            tokens, probs = self._draft(ints)
            host_tokens.copy_(tokens, non_blocking=True)
            host_probs.copy_(probs, non_blocking=True)
        graph, _ = capture_graph(body)
        torch.cuda.synchronize(self.device)
        self._graph = DraftGraph(graph, host_in, host_tokens, host_probs, torch.cuda.Event(), keep=(ints,))
        return self._graph

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        depth = min(self.shape.depth, max_depth)
        if depth <= 0:
            return DraftTree()
        topk_tokens, topk_probs = self.distributions(context[-1], len(context) - 1, depth)
        if not self.shape.tree:
            scores, p = [], 1.0
            for probs in topk_probs:
                p *= probs[0]
                scores.append(p)
            return DraftTree.chain([t[0] for t in topk_tokens], scores, topk_tokens=topk_tokens, topk_probs=topk_probs)
        w = self.shape.width  # at most `width` candidates per depth = at most `width` children per node
        tree = best_first_tree([t[:w] for t in topk_tokens], [p[:w] for p in topk_probs], self.shape.budget)
        return DraftTree(list(tree.tokens), list(tree.parents), list(tree.scores), topk_tokens=topk_tokens,
                         topk_probs=topk_probs)
