"""Batched speculative decoding: continuous batching over a paged KV cache, lossless per request.

Layers as in nano-vllm: BatchEngine (engine.py: the loop) over a Scheduler (scheduler.py: admission, chunked
prefill, rows and pages) and a BatchRunner (runner.py: paged cache, persistent buffers, CUDA graphs per token
bucket, on-device acceptance) running a pure forward (model.py) whose attention is the paged kernel
(paged_attn.py). The three batching mechanisms are BatchConfig knobs (config.py, mechanisms.py; the drafters the
host runs in drafting.py, those the step's graph runs in ngram_drafting.py and block_drafting.py, and mechanisms a
and b inside that graph in device_policy.py).
"""
from __future__ import annotations

import torch

from specpilot.engines.batch.clock import StepClock, WallClock
from specpilot.engines.batch.block_drafting import BatchBlockDrafter
from specpilot.engines.batch.config import (MECHANISMS, BatchConfig, DraftLength, VerifyBudget, batch_knob_schema,
                                            longest_draft)
from specpilot.engines.batch.cost import CostCurve, measure_cost_curve
from specpilot.engines.batch.device_policy import DevicePolicy
from specpilot.engines.batch.engine import BatchEngine, RequestResult, RequestSpec, RunResult
from specpilot.engines.batch.ngram_drafting import BatchNgramDrafter
from specpilot.engines.batch.runner import BatchRunner
from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.engines.drafters.block import BlockDrafterModel
from specpilot.engines.llama import LlamaModel


def block_width(cfg: EngineConfig, batch: BatchConfig) -> int:
    """Widest verify block an engine of (cfg, batch) builds: the pending token + its longest draft."""
    return 1 + longest_draft(cfg, batch)


def build_batch_engine(model: LlamaModel, cfg: EngineConfig, batch: BatchConfig, eos: frozenset[int],
                       device: torch.device | str, block_drafter: BlockDrafterModel | None = None,
                       **kw) -> BatchEngine:
    """A runner sized for this one engine, and the engine (share a runner between engines by hand). drafter=block
    takes the drafter's model in block_drafter: the runner then captures its target layers; device_draft gives the
    runner a BatchNgramDrafter (with a DevicePolicy when goodput or the verify budget is on)."""
    if cfg.lookup_periodic or cfg.lookup_depth:
        raise ConfigError("lookup_periodic and lookup_depth are single-request lookup knobs: the batched engine's "
                          "lookup has neither")
    block = (BatchBlockDrafter(block_drafter, model, batch.max_batch, cfg.max_seq_len, device,
                               cuda_graphs=cfg.cuda_graphs, window=cfg.drafter_window,
                               head_rows=cfg.drafter_head_rows)
             if block_drafter is not None else None)
    lookup = None
    if batch.device_draft and cfg.speculative:
        depth = longest_draft(cfg, batch)
        policy = DevicePolicy(batch.max_batch, depth, device) if batch.needs_cost_curve else None
        lookup = BatchNgramDrafter(batch.max_batch, cfg.max_seq_len, depth, cfg.ngram_min, cfg.ngram_max, device,
                                   policy=policy, extrapolate=batch.extrapolate, vocab=model.shape.vocab)
    runner = BatchRunner(model, cfg, batch, device, max_block=block_width(cfg, batch),
                         emulate_graphs=kw.pop("emulate_graphs", False),
                         drafters=[d for d in (block, lookup) if d is not None])
    return BatchEngine(runner, cfg, batch, eos, block_drafter=block, **kw)


__all__ = ["MECHANISMS", "BatchBlockDrafter", "BatchConfig", "BatchEngine", "BatchNgramDrafter", "BatchRunner",
           "CostCurve", "DevicePolicy", "DraftLength", "RequestResult", "RequestSpec", "RunResult", "StepClock",
           "VerifyBudget", "WallClock", "batch_knob_schema", "block_width", "build_batch_engine", "measure_cost_curve"]
