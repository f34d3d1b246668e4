"""A block drafter's draft with prompt lookup in front (EngineConfig.ngram_prefix).

Where the context repeats (code, quoted input, lists), prompt lookup predicts long exact continuations that a small
drafter misses; elsewhere it proposes nothing. A block drafter's depths are per-position predictions from the
context alone (not conditioned on the tokens drafted before them), so at each depth the lookup covers its token
leads the block's candidates (probability 1, the block's own after it, a duplicate of it dropped): a chain takes the
lookup's match then the block's top-1 tokens, a best-first tree grows the match as its main path and spends the
rest of its budget on the block's alternatives. Nothing the block drafts is lost where lookup has no match.

A lookup drafting deeper than the block (EngineConfig.lookup_depth, trees) leads past the block's depth alone: the
depths there have the match's token as their only candidate, so in a long repetitive stretch a step commits more
than a block.

A LeadGate (EngineConfig.lookup_agree_topk) lets the match lead only where the block does not contradict it: most
matches are 1-grams, and one of those overriding a confident block's right token ends the step's accepted path
where the block alone would have gone on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.engines.drafters.base import DraftTree
from specpilot.engines.drafters.block_tree import BlockTreeDrafter
from specpilot.engines.drafters.ngram import NgramDrafter


def lead_with(lead: int, tokens: list[int], probs: list[float]) -> tuple[list[int], list[float]]:
    """One depth's candidates with `lead` first (probability 1): the others keep their order, a duplicate goes, the
    count stays."""
    rest = [(t, p) for t, p in zip(tokens, probs) if t != lead][:len(tokens) - 1]
    return [lead] + [t for t, _ in rest], [1.0] + [p for _, p in rest]


@dataclass(frozen=True)
class LeadGate:
    """The match leads iff its first token is among the block's first `agree_topk` candidates at depth 1 or the
    block's top-1 probability there is below `doubt_prob` (compared in float32, as the device loop does)."""
    agree_topk: int
    doubt_prob: float

    def __post_init__(self) -> None:
        if self.agree_topk < 1 or not 0.0 <= self.doubt_prob <= 1.0:
            raise ValueError(f"agree_topk={self.agree_topk} must be >= 1, doubt_prob={self.doubt_prob} in 0..1")
        object.__setattr__(self, "doubt_prob", torch.tensor(self.doubt_prob, dtype=torch.float32).item())

    @classmethod
    def from_config(cls, agree_topk: int, doubt_prob: float) -> "LeadGate | None":
        return cls(agree_topk, doubt_prob) if agree_topk else None

    def leads(self, first: int, tokens: list[int], probs: list[float]) -> bool:
        """tokens / probs: the block's candidates at depth 1, best first."""
        return first in tokens[:self.agree_topk] or probs[0] < self.doubt_prob

    def leads_on_device(self, first: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """leads() as a 0-d bool tensor, no host read (the device loop's torch references); the kernels' twin is
        device_drafters.gate_leads."""
        return (tokens[:self.agree_topk] == first).any() | (probs[0] < self.doubt_prob)

    def gate_on_device(self, lead_depths: torch.Tensor, first: torch.Tensor, tokens: torch.Tensor,
                       probs: torch.Tensor) -> None:
        """lead_depths (a one-element tensor) becomes 0 in place where the gate refuses the lead (leads_on_device)."""
        lead_depths.copy_(torch.where(self.leads_on_device(first, tokens, probs), lead_depths, 0))


def led_by_lookup(lookup: list[int], tokens: list[list[int]], probs: list[list[float]], gate: LeadGate | None
                  ) -> tuple[list[list[int]], list[list[float]]]:
    """Per-depth candidates (best first) with the lookup's match leading at the depths it covers, unless the gate
    refuses the match (the engine's host rule; drafting.replay replays it). A match longer than the candidates' depths
    adds depths holding its token alone."""
    if lookup and gate is not None and not gate.leads(lookup[0], tokens[0], probs[0]):
        lookup = []
    tokens, probs = list(tokens), list(probs)
    extra = max(0, len(lookup) - len(tokens))
    tokens, probs = tokens + [[]] * extra, probs + [[]] * extra
    for d, t in enumerate(lookup):
        tokens[d], probs[d] = lead_with(t, tokens[d], probs[d])
    return tokens, probs


class NgramPrefixDrafter:
    def __init__(self, block: BlockTreeDrafter, ngram: NgramDrafter, gate: LeadGate | None = None):
        self.block, self.ngram, self.gate = block, ngram, gate
        self.observe, self.capture_all = block.observe, block.capture_all  # the engine feeds and captures the block

    def reset(self) -> None:
        self.block.reset()
        self.ngram.reset()

    def propose(self, context: list[int], max_depth: int, budget: int | None = None, chain: bool = False
                ) -> DraftTree:
        tokens, probs = self.block.candidates(context, max_depth)
        if not tokens:
            return DraftTree()
        # a tree may go deeper than the block where the lookup does (ngram.draft_len: EngineConfig.lookup_depth)
        lookup = self.ngram.propose(context, max_depth if self.block.shape.tree else len(tokens)).tokens
        return self.block.tree_of(*led_by_lookup(lookup, tokens, probs, self.gate), budget, chain)
