"""The target-runner interface both families' runners serve (ModelRunner, HybridRunner), and `fresh_runner`:
a second runner over an engine's own target, for work that must not touch the engine's cache.

Stages that run the target outside the engine loop (profile's kernel traces and cost curve, validate's token
forcing) need a runner of the same kind as the engine's, over the same (possibly transformed) weights and config,
with a cache of its own and, for token forcing, each position's top-k tokens (runner-up and top1-top2 margin).
They ask `fresh_runner(engine.target, ...)`; each runner class registers how it is rebuilt, so no stage names a
family.
"""
from __future__ import annotations

import functools
from typing import Protocol, Sequence

import numpy as np
import torch

from specpilot.engines.config import EngineConfig
from specpilot.engines.hybrid.runner import HybridRunner
from specpilot.engines.runner import ModelRunner, StepOutput


class TargetRunner(Protocol):
    """One sequence at a time: prefill a prompt, verify blocks (chains or trees) after it, commit accepted paths.

    With topk > 0 every StepOutput carries each row's top-k tokens and probabilities; margin (top1 - top2 logit)
    is set whenever a caller may need it (token forcing's tie log)."""

    cfg: EngineConfig
    device: torch.device
    block_width: int  # rows one verify may hold (root + draft nodes)

    def begin_request(self, total_tokens: int) -> None: ...

    def prefill(self, ids: list[int]) -> StepOutput: ...

    def verify(self, base: int, tokens: list[int], depths: list[int], anc: np.ndarray) -> StepOutput: ...

    def compact(self, base: int, path: Sequence[int]) -> None: ...


@functools.singledispatch
def fresh_runner(runner: TargetRunner, *, block_width: int | None = None, topk: int = 0) -> TargetRunner:
    """A new runner like `runner` (same model object, config and family knobs; block_width defaults to its own)
    with its own caches; topk > 0 serves each row's top-k tokens."""
    raise TypeError(f"no fresh_runner for target runners of type {type(runner).__name__}")


@fresh_runner.register
def _(runner: ModelRunner, *, block_width: int | None = None, topk: int = 0) -> ModelRunner:
    return ModelRunner(runner.model, runner.cfg, runner.device, block_width=block_width or runner.block_width,
                       topk=topk)


@fresh_runner.register
def _(runner: HybridRunner, *, block_width: int | None = None, topk: int = 0) -> HybridRunner:
    return HybridRunner(runner.model, runner.cfg, runner.hybrid, runner.device,
                        block_width=block_width or runner.block_width, topk=topk)
