"""The drafter interface: propose(context) -> DraftTree."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class DraftTree:
    """Draft nodes in topological order. parents[i] = -1 means the node hangs off the root (the last committed
    token); otherwise parents[i] < i. A chain has parents [-1, 0, 1, ...]."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # path probability (or match strength) per node
    # The drafter's per-depth candidates along its proposal, for the cost model's exact replay.
    topk_tokens: list[list[int]] = field(default_factory=list)
    topk_probs: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.scores)):
            raise ValueError("DraftTree tokens, parents and scores differ in length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"DraftTree node {i} has parent {p}: parents must precede their children")

    @classmethod
    def chain(cls, tokens: list[int], scores: list[float] | None = None, **traces) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), list(scores or [1.0] * len(tokens)), **traces)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """1-based depth of each node (children of the root have depth 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def truncated(self, max_nodes: int, max_depth: int) -> "DraftTree":
        """Keeps nodes within both limits; parents precede children, so a prefix filter stays a tree."""
        keep, depths = [], self.depths()
        remap: dict[int, int] = {-1: -1}
        for i, (p, d) in enumerate(zip(self.parents, depths)):
            if len(keep) < max_nodes and d <= max_depth and p in remap:
                remap[i] = len(keep)
                keep.append(i)
        return DraftTree([self.tokens[i] for i in keep], [remap[self.parents[i]] for i in keep],
                         [self.scores[i] for i in keep], self.topk_tokens[:max_depth], self.topk_probs[:max_depth])


class Drafter(Protocol):
    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        """Draft continuations of `context` (prompt + committed output), no deeper than max_depth."""
        ...

    def reset(self) -> None:
        """Forget per-request state (a new request starts)."""
        ...
