"""A block drafter's chain with prompt lookup in front (EngineConfig.ngram_prefix).

Where the context repeats (code, quoted input, lists), prompt lookup predicts long exact continuations that a small
drafter misses; elsewhere it proposes nothing. A block drafter's depths are per-position predictions from the
context alone (not conditioned on the tokens drafted before them), so the chain can take the n-gram proposal for
its first depths and the block's top-1 tokens for the rest: nothing the block drafts is lost where lookup has no
match, and a match replaces the block's guesses where it has one.
"""
from __future__ import annotations

from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.drafters.block_tree import BlockTreeDrafter
from specpilot.engines.drafters.ngram import NgramDrafter


class NgramPrefixDrafter:
    def __init__(self, block: BlockTreeDrafter, ngram: NgramDrafter):
        if block.shape.tree:
            raise ValueError("ngram_prefix drafts chains: the block drafter grows trees here")
        self.block, self.ngram = block, ngram
        self.observe, self.capture_all = block.observe, block.capture_all  # the engine feeds and captures the block

    def reset(self) -> None:
        self.block.reset()
        self.ngram.reset()

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        block = self.block.propose(context, max_depth)
        lookup = self.ngram.propose(context, len(block)).tokens
        n = len(lookup)
        tokens = lookup + block.tokens[n:]
        # traces: a looked-up depth's candidates are that token (probability 1), the block's elsewhere
        return DraftTree.chain(tokens, [1.0] * n + block.scores[n:],
                               topk_tokens=[[t] for t in lookup] + block.topk_tokens[n:],
                               topk_probs=[[1.0]] * n + block.topk_probs[n:])
