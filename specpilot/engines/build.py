"""Assemble a SpecEngine from an EngineConfig and loaded models."""
from __future__ import annotations

import torch

from specpilot.engines.config import ConfigError, DeviceTree, DrafterKind, EngineConfig, KernelBackend, VerifyMode
from specpilot.engines.device_drafters import BlockDeviceDrafter, NgramDeviceDrafter, NgramPrefixDeviceDrafter
from specpilot.engines.device_loop import DeviceLoop
from specpilot.engines.drafters.block import BlockDrafterModel
from specpilot.engines.drafters.block_fused import DraftLaunches
from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape
from specpilot.engines.drafters.draft_model import DraftModelDrafter
from specpilot.engines.drafters.ngram import NgramDrafter
from specpilot.engines.drafters.ngram_prefix import LeadGate, NgramPrefixDrafter
from specpilot.engines.engine import SpecEngine, StepBudgets
from specpilot.engines.hybrid.build import build_hybrid_engine
from specpilot.engines.hybrid.config import HybridConfig
from specpilot.engines.hybrid.model import HybridModel
from specpilot.engines.llama import LlamaModel
from specpilot.engines.policy import STOCK, EnginePolicy
from specpilot.engines.runner import ModelRunner
from specpilot.engines.two_level import LevelOne, LevelOneConfig, TwoLevelDrafter


def block_width(cfg: EngineConfig) -> int:
    """Widest verify block the config can produce (root + draft nodes), rounded up to the token tile."""
    nodes = {DrafterKind.NONE: 0, DrafterKind.NGRAM: cfg.draft_len, DrafterKind.DRAFT_MODEL: cfg.draft_len,
             DrafterKind.BLOCK: max(TreeShape.from_config(cfg).max_nodes, cfg.deep_tree_budget)}[cfg.drafter]
    width = max(nodes + 1, cfg.token_tile if cfg.batch_invariant else 1)
    tile = cfg.token_tile if cfg.batch_invariant else 1
    return -(-width // tile) * tile


def build_engine(cfg: EngineConfig, target: LlamaModel | HybridModel, eos: frozenset[int], device: str | torch.device,
                 draft_model: LlamaModel | None = None, policy: EnginePolicy = STOCK,
                 block_drafter: BlockDrafterModel | None = None) -> SpecEngine:
    """The engine for `target`'s family: hybrid recurrent targets get the hybrid runner (knobs from cfg, see
    HybridConfig.from_engine), Llama-family targets the stock runner."""
    if isinstance(target, HybridModel):  # block drafters and two-level verification are refused there
        return build_hybrid_engine(cfg, HybridConfig.from_engine(cfg), target, eos, device, draft_model=draft_model,
                                   policy=policy)
    if not isinstance(target, LlamaModel):
        raise ConfigError(f"no engine for targets of type {type(target).__name__} (Llama family or hybrid only)")
    # A block drafter reads target features: the runner captures the layers it was trained on.
    capture = block_drafter.config.target_layers if cfg.drafter is DrafterKind.BLOCK and block_drafter else ()
    runner = ModelRunner(policy.transform_weights(target), cfg, device, block_width=block_width(cfg), capture=capture)
    if cfg.drafter is DrafterKind.NONE:
        drafter = None
    elif cfg.drafter is DrafterKind.NGRAM:
        drafter = NgramDrafter(cfg.draft_len, cfg.ngram_max, cfg.ngram_min, cfg.lookup_periodic)
    elif cfg.drafter is DrafterKind.DRAFT_MODEL:
        drafter = DraftModelDrafter.for_target(draft_model, cfg, target.shape.vocab, device)
    elif cfg.drafter is DrafterKind.BLOCK:
        if block_drafter is None:
            raise ConfigError("drafter=block needs a block drafter model (specpilot.drafting.checkpoint.load_drafter)")
        try:
            # The drafter reads the stock target's embedding and LM head: drafts are only proposals.
            drafter = BlockTreeDrafter(block_drafter, target, TreeShape.from_config(cfg), cfg.max_seq_len, device,
                                       cuda_graphs=cfg.cuda_graphs,
                                       fused=cfg.kernel_backend is KernelBackend.TRITON,
                                       window=cfg.drafter_window, head_rows=cfg.drafter_head_rows,
                                       launches=DraftLaunches.of(cfg.drafter_launches, cfg.kernel_table,
                                                                  cfg.drafter_topk))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.ngram_prefix:
            lookup = NgramDrafter(max(cfg.lookup_depth, drafter.shape.depth), cfg.ngram_max, cfg.ngram_min,
                                  cfg.lookup_periodic)
            drafter = NgramPrefixDrafter(drafter, lookup,
                                         LeadGate.from_config(cfg.lookup_agree_topk, cfg.lookup_doubt_prob))
    else:
        raise ConfigError(f"drafter={cfg.drafter.value} is not available in this build")
    if cfg.verify is VerifyMode.TWO_LEVEL and drafter is not None:
        drafter = TwoLevelDrafter(drafter, LevelOne(runner, LevelOneConfig.from_config(cfg, target.shape.layers)))
    budgets = StepBudgets.from_config(cfg) if isinstance(drafter, (BlockTreeDrafter, NgramPrefixDrafter)) else None
    # (a deep step's tree or chain goes past the host loop's usual 64 depths: the device loop's steps, on the host)
    return SpecEngine(runner, drafter, eos, policy=policy, ar_steps=cfg.ar_steps,
                      max_depth=max(64, cfg.deep_tree_budget), device_loop=device_loop(cfg, runner, drafter),
                      budgets=budgets)


def device_loop(cfg: EngineConfig, runner: ModelRunner, drafter) -> DeviceLoop | None:
    """The device loop of drafters that have a device half (block, alone or led by lookup: chain or tree; n-gram:
    chain), or None: the host loop runs every step (device_steps=1 without device_overlap, two-level, draft models,
    blocks wider than one forward at the tile)."""
    if cfg.device_steps <= 1 and not cfg.device_overlap:
        return None
    if isinstance(drafter, BlockTreeDrafter):
        half, tree = BlockDeviceDrafter(drafter), drafter.shape if drafter.shape.tree else None
    elif isinstance(drafter, NgramPrefixDrafter):
        half = NgramPrefixDeviceDrafter(BlockDeviceDrafter(drafter.block), NgramDeviceDrafter(
            drafter.ngram, cfg.max_seq_len, runner.device, drafter.gate))
        tree = drafter.block.shape if drafter.block.shape.tree else None
    elif isinstance(drafter, NgramDrafter) and cfg.verify is VerifyMode.CHAIN:
        half, tree = NgramDeviceDrafter(drafter, cfg.max_seq_len, runner.device), None
    else:
        return None
    try:
        return DeviceLoop(runner, half, cfg.device_steps, tree, spine=isinstance(drafter, NgramPrefixDrafter),
                          overlap=cfg.device_overlap, per_step=cfg.device_tree is DeviceTree.PER_STEP,
                          observe_overlap=cfg.observe_overlap, lookup_overlap=cfg.lookup_overlap,
                          budgets=switched.extra if (switched := StepBudgets.from_config(cfg)) else (),
                          chains=(switched.deep,) if switched and switched.deep_chain else ())
    except ValueError:  # a block wider than one forward at this tile: the host loop runs it (same tokens)
        return None
