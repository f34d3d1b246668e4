"""Assemble a SpecEngine on a hybrid target: the stock engine loop over a HybridRunner."""
from __future__ import annotations

import torch

from specpilot.engines.build import block_width
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
from specpilot.engines.runner import ModelRunner


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


class HybridDrafter:
    """Fits a drafter's proposals to the hybrid runner: a chain when verify_tree is off, and at most the nodes
    one verify block holds (a prefix in topological order stays a tree)."""

    def __init__(self, inner: Drafter, verify_tree: bool, max_nodes: int):
        self.inner, self.verify_tree, self.max_nodes = inner, verify_tree, max_nodes

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, context: list[int], max_depth: int) -> DraftTree:
        tree = self.inner.propose(context, max_depth)
        if not self.verify_tree:
            tree = best_chain(tree)
        return tree.truncated(self.max_nodes, max_depth)


def build_hybrid_engine(cfg: EngineConfig, hybrid: HybridConfig, target: HybridModel, eos: frozenset[int],
                        device: str | torch.device, drafter: Drafter | None = None,
                        draft_model: LlamaModel | None = None, policy: EnginePolicy = STOCK,
                        max_draft_nodes: int | None = None) -> SpecEngine:
    """AR when cfg.drafter is NONE; otherwise `drafter` if given, else the one cfg names (n-gram, draft model).

    max_draft_nodes sizes the verify block (default: what cfg's drafter can propose); larger proposals are
    truncated. Block drafters (they read target features) and two-level verification are Llama-only for now.
    """
    if cfg.drafter is DrafterKind.BLOCK and drafter is None:
        raise ConfigError("drafter=block is not available on hybrid targets (it reads Llama target features)")
    if cfg.verify is VerifyMode.TWO_LEVEL:
        raise ConfigError("verify=two_level is not available on hybrid targets")
    tile = cfg.token_tile if cfg.batch_invariant else 1
    width = block_width(cfg) if max_draft_nodes is None else -(-(max_draft_nodes + 1) // tile) * tile
    runner = HybridRunner(target, cfg, hybrid, device, block_width=width)
    if cfg.drafter is DrafterKind.NONE:
        return SpecEngine(runner, None, eos, policy=policy)
    if drafter is None and cfg.drafter is DrafterKind.NGRAM:
        drafter = NgramDrafter(cfg.draft_len, cfg.ngram_max, cfg.ngram_min)
    elif drafter is None and cfg.drafter is DrafterKind.DRAFT_MODEL:
        if draft_model is None:
            raise ConfigError("drafter=draft_model needs a draft model")
        if draft_model.shape.vocab != target.shape.vocab:
            raise ConfigError(f"draft model vocab {draft_model.shape.vocab} != target vocab {target.shape.vocab}")
        draft_cfg = cfg.replace(batch_invariant=False, compile=False)
        drafter = DraftModelDrafter(ModelRunner(draft_model, draft_cfg, device, block_width=16, topk=4), cfg.draft_len)
    return SpecEngine(runner, HybridDrafter(drafter, hybrid.verify_tree, runner.block_width - 1), eos, policy=policy)
