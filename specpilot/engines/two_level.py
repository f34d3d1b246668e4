"""Two-level verification: a cheap first level prunes the draft tree, the full target decides.

Level one shrinks a tree of up to tree_budget nodes to level_one_keep nodes by a cheap rule:
- CONFIDENCE: keep the nodes of highest path probability (the drafter's own scores);
- SHALLOW: run the target's first few layers, its final norm and LM head over the whole tree (ancestor-only
  mask, the real KV cache), keep the path the shallow model would accept, then fill the rest of the budget
  by path probability.
Level two is the engine's normal verify of the pruned tree. Lossless by construction: level one only chooses
which candidates the full target sees, and acceptance is still the full target's argmax. The shallow pass
writes KV for its tree into the block slots of its layers; those slots are invisible (at or above the base)
until the full verify rewrites them, so it cannot leak into the committed context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.engines.config import EngineConfig, LevelOneRule
from specpilot.engines.drafters.base import DraftTree, Drafter
from specpilot.engines.engine import greedy_accept
from specpilot.engines.llama import visibility_mask
from specpilot.engines.layout import tree_anc
from specpilot.engines.runner import ModelRunner


SHALLOW_FRACTION = 4  # default shallow pass depth: target layers // 4, at least 1


@dataclass(frozen=True)
class LevelOneConfig:
    rule: LevelOneRule
    keep: int  # nodes passed on to the full verify
    shallow_layers: int  # target layers run by the SHALLOW rule

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule", LevelOneRule(self.rule))
        if self.keep < 1 or self.shallow_layers < 1:
            raise ValueError(f"keep={self.keep}, shallow_layers={self.shallow_layers}: must be >= 1")

    @classmethod
    def from_config(cls, cfg: EngineConfig, target_layers: int) -> "LevelOneConfig":
        layers = cfg.level_one_layers or max(1, target_layers // SHALLOW_FRACTION)
        return cls(cfg.level_one_rule, cfg.level_one_keep, min(layers, target_layers))


def prune(tree: DraftTree, keep: int, first: tuple[int, ...] = ()) -> DraftTree:
    """The sub-tree of at most `keep` nodes: the nodes in `first` (a root path, in depth order), then the rest by
    descending score; a node joins only when its parent is in, so the result stays ancestor-closed."""
    head = set(first)
    order = list(first) + sorted((i for i in range(len(tree)) if i not in head), key=lambda i: -tree.scores[i])
    kept: set[int] = set()
    for i in order:
        if len(kept) >= keep:
            break
        p = tree.parents[i]
        if p < 0 or p in kept:
            kept.add(i)
    nodes = sorted(kept)  # original (topological) order
    index = {old: new for new, old in enumerate(nodes)}
    return DraftTree([tree.tokens[i] for i in nodes], [index.get(tree.parents[i], -1) for i in nodes],
                     [tree.scores[i] for i in nodes], tree.topk_tokens, tree.topk_probs)


@torch.no_grad()
def shallow_argmax(runner: ModelRunner, base: int, block: list[int], parents: list[int], layers: int) -> list[int]:
    """Greedy tokens after each block token (root first) from the target's first `layers` layers + final
    norm + LM head, attending to the committed context and the token's ancestors."""
    model, dev = runner.model, runner.device
    n = len(block)
    if base + n > runner.num_slots:
        raise ValueError(f"shallow pass of {n} tokens at {base} exceeds the KV cache ({runner.num_slots} slots)")
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    ids = torch.tensor(block, device=dev)
    pos = torch.tensor([base + d for d in depths], device=dev)
    slots = torch.arange(base, base + n, device=dev)
    mask = visibility_mask(torch.tensor(base, device=dev), torch.from_numpy(tree_anc(parents)).to(dev), runner.num_slots)
    x = model.embed_tokens(ids)
    cos, sin = model.rotary(pos, x.dtype)
    for i in range(min(layers, len(model.layers))):
        x = model.layers[i](x, cos, sin, runner.kv[0][i], runner.kv[1][i], slots, mask)
    return model.logits(model.norm(x)).argmax(-1).tolist()


class LevelOne:
    def __init__(self, runner: ModelRunner, config: LevelOneConfig):
        self.runner, self.config = runner, config

    def __call__(self, tree: DraftTree, context: list[int]) -> DraftTree:
        if len(tree) <= self.config.keep:
            return tree
        first: tuple[int, ...] = ()
        if self.config.rule is LevelOneRule.SHALLOW:
            block = [context[-1]] + tree.tokens
            parents = [-1] + [p + 1 for p in tree.parents]
            votes = shallow_argmax(self.runner, len(context) - 1, block, parents, self.config.shallow_layers)
            first = tuple(i - 1 for i in greedy_accept(block, parents, votes).path[1:])
        return prune(tree, self.config.keep, first)


class TwoLevelDrafter:
    """Wraps any drafter: its proposals go through level one before the engine verifies them."""

    def __init__(self, inner: Drafter, level_one: LevelOne):
        self.inner, self.level_one = inner, level_one
        if hasattr(inner, "observe"):  # the engine feeds target features only to drafters that observe
            self.observe = inner.observe
        if hasattr(inner, "capture_all"):  # and captures the graphs of drafters that have them
            self.capture_all = inner.capture_all

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        return self.level_one(self.inner.propose(context, max_depth), context)

