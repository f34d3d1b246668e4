"""Acceptance under greedy verification: the closed form, best-first draft trees and their exact replay.

The closed form is the textbook sanity check (i.i.d. acceptance rate alpha along a chain of k drafts). The
tree functions rebuild, from a step's recorded drafter distributions, the tree a perfect best-first shaper
would have verified, and replay it against the target's actual continuation to count what it would accept.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = -1  # parent index of the nodes that hang directly under the last committed token


def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: must be in [0, 1]")
    if k < 0:
        raise ValueError(f"k={k}: must be >= 0")


def expected_accepted(alpha: float, k: int) -> float:
    """Expected tokens committed per step, bonus included: E = (1 - alpha^(k+1)) / (1 - alpha).

    Draft i (1-based) is accepted with probability alpha^i, and the bonus token always comes, so
    E = sum_{i=0..k} alpha^i; that sum is used near alpha = 1 where the quotient cancels catastrophically.
    """
    _check_alpha_k(alpha, k)
    if 1.0 - alpha < 1e-6:
        return math.fsum(alpha ** i for i in range(k + 1))
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def closed_form_speedup(alpha: float, k: int, c: float) -> float:
    """Speedup over autoregressive decoding: E / (1 + k c), c = cost of one draft token / one target step."""
    if c < 0.0:
        raise ValueError(f"c={c}: must be >= 0")
    return expected_accepted(alpha, k) / (1.0 + k * c)


@dataclass(frozen=True)
class Tree:
    """A draft tree in topological order: every node's parent comes before it (ROOT for the first level)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    scores: tuple[float, ...]  # product of drafter probabilities along the root path (1.0 for hand-built trees)

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.scores)):
            raise ValueError(f"tokens ({len(self.tokens)}), parents ({len(self.parents)}) and scores "
                             f"({len(self.scores)}) must have one entry per node")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must be ROOT ({ROOT}) or an earlier node")

    @classmethod
    def from_edges(cls, tokens: Sequence[int], parents: Sequence[int]) -> "Tree":
        return cls(tuple(tokens), tuple(parents), tuple(1.0 for _ in tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return tuple(depths)

    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node's token path from the root, in node order."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append((token,) if parent == ROOT else paths[parent] + (token,))
        return tuple(paths)

    def prefix(self, budget: int) -> "Tree":
        return Tree(self.tokens[:budget], self.parents[:budget], self.scores[:budget])


def _levels(topk_tokens: Sequence[Sequence[int]], topk_probs: Sequence[Sequence[float]]) -> list[list[tuple[int, float]]]:
    """Per depth, (token, probability) sorted by probability, most likely first (ties keep recorded order)."""
    if len(topk_tokens) != len(topk_probs):
        raise ValueError(f"topk_tokens has {len(topk_tokens)} depths, topk_probs {len(topk_probs)}")
    levels = []
    for depth, (tokens, probs) in enumerate(zip(topk_tokens, topk_probs), start=1):
        if len(tokens) != len(probs):
            raise ValueError(f"depth {depth}: {len(tokens)} tokens but {len(probs)} probabilities")
        merged: dict[int, float] = {}
        for token, prob in zip(tokens, probs):
            if not math.isfinite(prob) or prob < 0.0:
                raise ValueError(f"depth {depth}: probability {prob} of token {token} is not a finite value >= 0")
            # A token listed twice is one candidate: its probability is the total the drafter gave it.
            merged[int(token)] = merged.get(int(token), 0.0) + float(prob)
        # Zero-probability candidates are ones the drafter rules out; a shaper never spends budget on them.
        level = [(token, prob) for token, prob in merged.items() if prob > 0.0]
        levels.append(sorted(level, key=lambda tp: -tp[1]))
    return levels


def best_first_tree(topk_tokens: Sequence[Sequence[int]], topk_probs: Sequence[Sequence[float]], budget: int) -> Tree:
    """Grow the tree of the `budget` most likely paths.

    Depth d's candidates are taken as independent of the path above them (a block drafter's per-position
    distributions; a chain drafter's are recorded along its own path, the same assumption), so a node's score
    is the product of its path's probabilities. Nodes are added best first from a heap of frontier nodes.
    Because siblings are sorted and a child never outranks its parent's turn, popping a node only needs to
    push its next sibling and its first child, and the tree for budget b is the first b nodes of any larger
    one (ties broken by depth, then candidate rank, so the order is deterministic).
    """
    if budget < 0:
        raise ValueError(f"budget={budget}: must be >= 0")
    levels = _levels(topk_tokens, topk_probs)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    # Heap entry: (-score, depth, candidate ranks along the path, parent node index, parent score).
    heap: list[tuple[float, int, tuple[int, ...], int, float]] = []
    if levels and levels[0]:
        heap.append((-levels[0][0][1], 1, (0,), ROOT, 1.0))
    while heap and len(tokens) < budget:
        neg_score, depth, ranks, parent, parent_score = heapq.heappop(heap)
        level = levels[depth - 1]
        node = len(tokens)
        tokens.append(level[ranks[-1]][0])
        parents.append(parent)
        scores.append(-neg_score)
        if ranks[-1] + 1 < len(level):
            sibling_score = parent_score * level[ranks[-1] + 1][1]
            heapq.heappush(heap, (-sibling_score, depth, ranks[:-1] + (ranks[-1] + 1,), parent, parent_score))
        if depth < len(levels) and levels[depth]:
            child_score = -neg_score * levels[depth][0][1]
            heapq.heappush(heap, (-child_score, depth + 1, ranks + (0,), node, -neg_score))
    return Tree(tuple(tokens), tuple(parents), tuple(scores))


def replay_prefix_accepted(tree: Tree, target_tokens: Sequence[int]) -> tuple[int, ...]:
    """accepted[b] = what the tree's first b nodes accept against the target's continuation, b = 0..len(tree).

    A node is accepted when its parent is (or is the root) and its token is the target's token at its depth;
    greedy verification accepts the deepest such node's path.
    """
    accepted = [0]
    matched: list[bool] = []
    depths = tree.depths
    for token, parent, depth in zip(tree.tokens, tree.parents, depths):
        on_path = parent == ROOT or matched[parent]
        is_match = on_path and depth <= len(target_tokens) and token == target_tokens[depth - 1]
        matched.append(is_match)
        accepted.append(max(accepted[-1], depth if is_match else 0))
    return tuple(accepted)


def replay_accepted(tree: Tree, target_tokens: Sequence[int]) -> int:
    """Length of the longest root path equal to a prefix of the target's continuation (bonus excluded)."""
    return replay_prefix_accepted(tree, target_tokens)[-1]
