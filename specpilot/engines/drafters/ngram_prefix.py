"""A block drafter's draft with prompt lookup in front (EngineConfig.ngram_prefix).

Where the context repeats (code, quoted input, lists), prompt lookup predicts long exact continuations that a small
drafter misses; elsewhere it proposes nothing. A block drafter's depths are per-position predictions from the
context alone (not conditioned on the tokens drafted before them), so at each depth the lookup covers its token
leads the block's candidates (probability 1, the block's own after it, a duplicate of it dropped): a chain takes the
lookup's match then the block's top-1 tokens, a best-first tree grows the match as its main path and spends the
rest of its budget on the block's alternatives. Nothing the block drafts is lost where lookup has no match.
"""
from __future__ import annotations

from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.drafters.block_tree import BlockTreeDrafter
from specpilot.engines.drafters.ngram import NgramDrafter


def lead_with(lead: int, tokens: list[int], probs: list[float]) -> tuple[list[int], list[float]]:
    """One depth's candidates with `lead` first (probability 1): the others keep their order, a duplicate goes, the
    count stays."""
    rest = [(t, p) for t, p in zip(tokens, probs) if t != lead][:len(tokens) - 1]
    return [lead] + [t for t, _ in rest], [1.0] + [p for _, p in rest]


class NgramPrefixDrafter:
    def __init__(self, block: BlockTreeDrafter, ngram: NgramDrafter):
        self.block, self.ngram = block, ngram
        self.observe, self.capture_all = block.observe, block.capture_all  # the engine feeds and captures the block

    def reset(self) -> None:
        self.block.reset()
        self.ngram.reset()

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        tokens, probs = self.block.candidates(context, max_depth)
        if not tokens:
            return DraftTree()
        for d, t in enumerate(self.ngram.propose(context, len(tokens)).tokens):
            tokens[d], probs[d] = lead_with(t, tokens[d], probs[d])
        return self.block.tree_of(tokens, probs)
