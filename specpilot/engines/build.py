"""Assemble a SpecEngine from an EngineConfig and loaded models."""
from __future__ import annotations

import torch

from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig
from specpilot.engines.drafters.draft_model import DraftModelDrafter
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.engine import SpecEngine
from specpilot.engines.llama import LlamaModel
from specpilot.engines.policy import STOCK, EnginePolicy
from specpilot.engines.runner import ModelRunner


def block_width(cfg: EngineConfig) -> int:
    """Widest verify block the config can produce (root + draft nodes), rounded up to the token tile."""
    nodes = {DrafterKind.NONE: 0, DrafterKind.NGRAM: cfg.draft_len, DrafterKind.DRAFT_MODEL: cfg.draft_len,
             DrafterKind.BLOCK: cfg.tree_budget}[cfg.drafter]
    width = max(nodes + 1, cfg.token_tile if cfg.batch_invariant else 1)
    tile = cfg.token_tile if cfg.batch_invariant else 1
    return -(-width // tile) * tile


def build_engine(cfg: EngineConfig, target: LlamaModel, eos: frozenset[int], device: str | torch.device,
                 draft_model: LlamaModel | None = None, policy: EnginePolicy = STOCK) -> SpecEngine:
    runner = ModelRunner(policy.transform_weights(target), cfg, device, block_width=block_width(cfg))
    if cfg.drafter is DrafterKind.NONE:
        drafter = None
    elif cfg.drafter is DrafterKind.NGRAM:
        drafter = NgramDrafter(cfg.draft_len, cfg.ngram_max, cfg.ngram_min)
    elif cfg.drafter is DrafterKind.DRAFT_MODEL:
        if draft_model is None:
            raise ConfigError("drafter=draft_model needs a draft model")
        if draft_model.shape.vocab != target.shape.vocab:
            raise ConfigError(f"draft model vocab {draft_model.shape.vocab} != target vocab {target.shape.vocab}")
        # The drafter runs at its fastest shapes: its outputs are only proposals, verified by the target.
        draft_cfg = cfg.replace(batch_invariant=False, compile=False)
        drafter = DraftModelDrafter(ModelRunner(draft_model, draft_cfg, device, block_width=16, topk=4), cfg.draft_len)
    else:
        raise ConfigError(f"drafter={cfg.drafter.value} is not available in this build")
    return SpecEngine(runner, drafter, eos, policy=policy)
