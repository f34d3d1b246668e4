"""Assemble a SpecEngine on a hybrid target: the stock engine loop over a HybridRunner."""
from __future__ import annotations

import torch

from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig, VerifyMode
from specpilot.engines.drafters.base import DraftTree, Drafter
from specpilot.engines.drafters.draft_model import DraftModelDrafter
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.engine import SpecEngine
from specpilot.engines.hybrid.config import HybridConfig
from specpilot.engines.hybrid.model import HybridModel
from specpilot.engines.hybrid.runner import HybridRunner
from specpilot.engines.llama import LlamaModel
from specpilot.engines.policy import STOCK, EnginePolicy


def best_chain(tree: DraftTree) -> DraftTree:
    """The root path to the node with the highest score (deeper, then earlier, on ties), as a chain."""
    if tree.parents == list(range(-1, len(tree) - 1)):
        return tree
    depths = tree.depths()
    node = max(range(len(tree)), key=lambda i: (tree.scores[i], depths[i], -i))
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    path.reverse()
    return DraftTree.chain([tree.tokens[i] for i in path], [tree.scores[i] for i in path],
                           topk_tokens=tree.topk_tokens, topk_probs=tree.topk_probs)


def with_alternatives(tree: DraftTree, budget: int, width: int) -> DraftTree:
    """A chain grown into a tree from the drafter's own per-depth candidates (topk_tokens/topk_probs): the other
    candidates at each depth become leaf siblings of the chain node there, best-first by path score, at most
    width - 1 per depth and `budget` nodes in all (the chain stays whole). Leaves cost a hybrid verify no state
    traffic (depth-first order keeps their parent's state on chip), so a tree buys tokens where the chain's guess
    is wrong for little more than the rows. Trees and chains without candidates pass through."""
    n = len(tree)
    if width < 2 or n >= budget or tree.parents != list(range(-1, n - 1)):
        return tree
    extra: list[tuple[float, int, int]] = []  # (path score, depth index, token)
    path = 1.0  # probability of the chain up to the current depth's parent
    for d, (cands, probs) in enumerate(zip(tree.topk_tokens[:n], tree.topk_probs[:n])):
        alts = [(path * p, d, t) for t, p in zip(cands, probs) if t != tree.tokens[d]]
        extra += alts[:width - 1]
        path *= next((p for t, p in zip(cands, probs) if t == tree.tokens[d]), 0.0)
    chosen = sorted(sorted(extra, key=lambda e: (-e[0], e[1]))[:budget - n], key=lambda e: e[1])
    return DraftTree(tree.tokens + [t for _, _, t in chosen], tree.parents + [d - 1 for _, d, _ in chosen],
                     tree.scores + [score for score, _, _ in chosen], tree.topk_tokens, tree.topk_probs)


class HybridDrafter:
    """Fits a drafter's proposals to the hybrid runner: a chain when verify_tree is off, else its tree (a chain
    grown by its own alternatives, see with_alternatives), at most `max_nodes` nodes (a prefix in topological
    order stays a tree)."""

    def __init__(self, inner: Drafter, verify_tree: bool, max_nodes: int, width: int = 1):
        self.inner, self.verify_tree, self.max_nodes, self.width = inner, verify_tree, max_nodes, width

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        tree = self.inner.propose(context, max_depth)
        tree = with_alternatives(tree, self.max_nodes, self.width) if self.verify_tree else best_chain(tree)
        return tree.truncated(self.max_nodes, max_depth)


def draft_nodes(cfg: EngineConfig, hybrid: HybridConfig) -> int:
    """Draft nodes a verify block holds: the drafter's chain, or the tree budget when trees are verified."""
    if cfg.drafter is DrafterKind.NONE:
        return 0
    return max(cfg.draft_len, cfg.tree_budget) if hybrid.verify_tree else cfg.draft_len


def build_hybrid_engine(cfg: EngineConfig, hybrid: HybridConfig, target: HybridModel, eos: frozenset[int],
                        device: str | torch.device, drafter: Drafter | None = None,
                        draft_model: LlamaModel | None = None, policy: EnginePolicy = STOCK,
                        max_draft_nodes: int | None = None) -> SpecEngine:
    """AR when cfg.drafter is NONE; otherwise `drafter` if given, else the one cfg names (n-gram, draft model).

    max_draft_nodes sizes the verify block (default: draft_nodes(cfg, hybrid)); larger proposals are truncated.
    Block drafters (they read target features) and two-level verification are Llama-only for now.
    """
    if cfg.drafter is DrafterKind.BLOCK and drafter is None:
        raise ConfigError("drafter=block is not available on hybrid targets (it reads Llama target features)")
    if cfg.verify is VerifyMode.TWO_LEVEL:
        raise ConfigError("verify=two_level is not available on hybrid targets")
    if type(policy).transform_weights is not EnginePolicy.transform_weights:
        # Weight transforms are written for Llama modules; silently skipping one would validate a mechanism that
        # never ran.
        raise ConfigError(f"policy {type(policy).__name__} transforms weights, which hybrid targets do not support")
    nodes = draft_nodes(cfg, hybrid) if max_draft_nodes is None else max_draft_nodes
    tile = cfg.token_tile if cfg.batch_invariant else 1
    runner = HybridRunner(target, cfg, hybrid, device, block_width=-(-(nodes + 1) // tile) * tile)
    if cfg.drafter is DrafterKind.NONE:
        return SpecEngine(runner, None, eos, policy=policy)
    if drafter is None and cfg.drafter is DrafterKind.NGRAM:
        drafter = NgramDrafter(cfg.draft_len, cfg.ngram_max, cfg.ngram_min, cfg.lookup_periodic)
    elif drafter is None and cfg.drafter is DrafterKind.DRAFT_MODEL:
        drafter = DraftModelDrafter.for_target(draft_model, cfg, target.shape.vocab, device)
    verify = HybridDrafter(drafter, hybrid.verify_tree, min(runner.block_width - 1, nodes), cfg.tree_width)
    return SpecEngine(runner, verify, eos, policy=policy)
