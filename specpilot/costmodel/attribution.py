"""attribute(): the three factors of the gap to the ceiling, their product, and the ranked directions.

Total gap = (1 / tau) x kernel factor x overhead factor: each term is "how many times faster it could be"
(tau is a ratio of tokens, so its reciprocal is the time-like term). The largest excess names this round's
direction for the explore stage.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from specpilot.costmodel.classify import short_kernel_name
from specpilot.costmodel.kernel_factor import (DEFAULT_LAUNCH_LATENCY_S, Ceilings, CostShape, KernelFactor,
                                              kernel_factor)
from specpilot.costmodel.serialize import from_jsonable, to_jsonable
from specpilot.costmodel.tau import DEFAULT_BUDGETS, CostCurveLike, TauFactor, tau_factor
from specpilot.engines.traces import KernelTrace, StepTrace

TOP_GAPS_IN_RATIONALE = 3


class DirectionName(str, Enum):
    TREE_SHAPE = "tree_shape"  # the tau factor: draft tree shape / node budget
    KERNELS = "kernels"  # the kernel factor: kernels far from their roofline
    OVERHEAD = "overhead"  # the overhead factor: host work, syncs, launch gaps


@dataclass(frozen=True)
class OverheadFactor:
    factor: float  # wall_s / kernel_s
    wall_s: float  # mean measured wall time per step (drafting + verification)
    kernel_s: float  # profiled kernel time per step
    draft_s: float  # mean host drafting time per step
    verify_s: float  # mean verify wall time per step


def overhead_factor(steps: Sequence[StepTrace], kernel_s_per_step: float) -> OverheadFactor:
    """Measured wall step time over profiled kernel time per step (host work, syncs, launch gaps)."""
    if not steps:
        raise ValueError("no step traces to measure wall step time from")
    if not kernel_s_per_step > 0.0:
        raise ValueError(f"kernel_s_per_step={kernel_s_per_step}: must be > 0")
    draft_s = statistics.fmean(s.draft_s for s in steps)
    verify_s = statistics.fmean(s.verify_s for s in steps)
    wall_s = draft_s + verify_s
    return OverheadFactor(wall_s / kernel_s_per_step, wall_s, kernel_s_per_step, draft_s, verify_s)


@dataclass(frozen=True)
class Direction:
    name: DirectionName
    factor: float  # the factor as a time ratio (>= 1 means room to gain)
    predicted_gain: float  # the factor's excess, factor - 1, floored at 0
    rationale: str


@dataclass(frozen=True)
class Attribution:
    tau: TauFactor
    kernel: KernelFactor
    overhead: OverheadFactor
    total_gap: float  # (1 / tau) x kernel x overhead
    directions: tuple[Direction, ...]  # largest predicted gain first

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Attribution":
        return from_jsonable(cls, data)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _tree_rationale(tau: TauFactor) -> str:
    return (f"best-first tree at budget {tau.best_budget} accepts {tau.optimal_tokens_per_step:.2f} tokens/step "
            f"vs {tau.current_tokens_per_step:.2f} now (tau {tau.tau:.3f}); predicted speedup "
            f"{tau.optimal_predicted_speedup:.2f}x vs {tau.current_predicted_speedup:.2f}x")


def _kernel_rationale(kernel: KernelFactor) -> str:
    gaps = [g for g in kernel.op_gaps if g.excess_s > 0.0][:TOP_GAPS_IN_RATIONALE]
    parts = []
    for g in gaps:
        ratio = f"{g.gap:.2f}x ideal" if g.gap is not None else "no ideal"
        parts.append(f"{g.op.value} {ratio} (+{_ms(g.excess_s)}, {g.bound.value}-bound, "
                     f"top kernel {short_kernel_name(g.top_kernel)})")
    detail = "; ".join(parts) if parts else "no op class exceeds its ideal"
    return f"kernels take {kernel.factor:.2f}x their roofline ideal; largest gaps: {detail}"


def _overhead_rationale(overhead: OverheadFactor, kernel: KernelFactor) -> str:
    return (f"wall step {_ms(overhead.wall_s)} (draft {_ms(overhead.draft_s)}, verify {_ms(overhead.verify_s)}) "
            f"vs kernels {_ms(overhead.kernel_s)}; {kernel.launches:.0f} launches/step x "
            f"{kernel.launch_latency_s * 1e6:.1f} us = {_ms(kernel.launch_overhead_s)} of launch latency")


def rank_directions(tau: TauFactor, kernel: KernelFactor, overhead: OverheadFactor) -> tuple[Direction, ...]:
    """Directions by predicted gain, largest first; ties keep tree shape, kernels, overhead order."""
    directions = [
        Direction(DirectionName.TREE_SHAPE, tau.gap, max(0.0, tau.gap - 1.0), _tree_rationale(tau)),
        Direction(DirectionName.KERNELS, kernel.factor, max(0.0, kernel.factor - 1.0), _kernel_rationale(kernel)),
        Direction(DirectionName.OVERHEAD, overhead.factor, max(0.0, overhead.factor - 1.0),
                  _overhead_rationale(overhead, kernel)),
    ]
    return tuple(sorted(directions, key=lambda d: -d.predicted_gain))


def _profiled_tokens(kernels: Sequence[KernelTrace]) -> int:
    widths = {k.tokens for k in kernels}
    if not widths:
        raise ValueError("no kernel traces to attribute")
    if len(widths) != 1:
        raise ValueError(f"kernel traces mix forward widths {sorted(widths)}; pass tokens= explicitly")
    return widths.pop()


def attribute(steps: Sequence[StepTrace], kernels: Sequence[KernelTrace], shape: CostShape, ceilings: Ceilings,
              cost_curve: CostCurveLike, *, budgets: Sequence[int] = DEFAULT_BUDGETS, weight_bytes: float = 2.0,
              act_bytes: int = 2, launch_latency_s: float = DEFAULT_LAUNCH_LATENCY_S, tokens: int | None = None,
              context: int | None = None) -> Attribution:
    """The cost model over one profile's traces.

    tokens defaults to the kernel traces' forward width, context to the mean committed length at the steps.
    """
    if not steps:
        raise ValueError("no step traces to attribute")
    tau = tau_factor(steps, cost_curve, budgets)
    width = _profiled_tokens(kernels) if tokens is None else tokens
    cached = round(statistics.fmean(s.position for s in steps)) if context is None else context
    kernel = kernel_factor(kernels, shape, width, cached, ceilings, weight_bytes, act_bytes, launch_latency_s)
    overhead = overhead_factor(steps, kernel.measured_s)
    return Attribution(tau=tau, kernel=kernel, overhead=overhead,
                       total_gap=tau.gap * kernel.factor * overhead.factor,
                       directions=rank_directions(tau, kernel, overhead))
