"""The kernel factor: profiled kernel time per step over the roofline ideal of the same forward.

The ideal of an op class is max(FLOPs / (0.6 x peak FLOP/s), bytes / (0.9 x peak bandwidth)) for the
fewest bytes it must move (the shape's op_costs: LlamaShape's or HybridShape's). The peaks are measured by the
profile stage on the machine itself and handed in as Ceilings.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from specpilot.costmodel.classify import kernel_op_classes
from specpilot.engines.shapes import OpClass
from specpilot.engines.traces import KernelTrace

FLOP_EFFICIENCY = 0.6  # fraction of peak FLOP/s a well-tuned GEMM reaches at decode shapes
BANDWIDTH_EFFICIENCY = 0.9  # fraction of peak bandwidth a streaming kernel reaches
# A typical CUDA launch on a recent driver; the profile stage passes the machine's measured value when it has one.
DEFAULT_LAUNCH_LATENCY_S = 4e-6


class CostShape(Protocol):
    """A model shape the cost model can price: either target family's (LlamaShape, HybridShape)."""

    def op_costs(self, tokens: int, context: int, weight_bytes: float = 2.0,
                 act_bytes: int = 2) -> dict[OpClass, tuple[float, float]]: ...


class Bound(str, Enum):
    COMPUTE = "compute"
    MEMORY = "memory"
    UNMODELLED = "unmodelled"  # OTHER: kernels the cost model has no ideal for


@dataclass(frozen=True)
class Ceilings:
    peak_flops: float  # FLOP/s, measured (large matmul)
    peak_bandwidth: float  # bytes/s, measured (large copy)

    def __post_init__(self) -> None:
        for name in ("peak_flops", "peak_bandwidth"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name}={value}: must be a finite value > 0")


@dataclass(frozen=True)
class OpIdeal:
    op: OpClass
    flops: float
    bytes: float
    ideal_s: float
    bound: Bound


def ideal_op_times(shape: CostShape, tokens: int, context: int, ceilings: Ceilings,
                   weight_bytes: float = 2.0, act_bytes: int = 2) -> dict[OpClass, OpIdeal]:
    """Roofline ideal time of each op class for one forward of `tokens` tokens over `context` cached keys."""
    ideals = {}
    for op, (flops, nbytes) in shape.op_costs(tokens, context, weight_bytes, act_bytes).items():
        compute_s = flops / (FLOP_EFFICIENCY * ceilings.peak_flops)
        memory_s = nbytes / (BANDWIDTH_EFFICIENCY * ceilings.peak_bandwidth)
        bound = Bound.COMPUTE if compute_s > memory_s else Bound.MEMORY
        ideals[op] = OpIdeal(op, flops, nbytes, max(compute_s, memory_s), bound)
    return ideals


@dataclass(frozen=True)
class OpGap:
    op: OpClass
    measured_s: float  # per step, the share of kernel time attributed to this class
    ideal_s: float  # per step
    bound: Bound
    gap: float | None  # measured / ideal; None where there is no ideal (OTHER)
    top_kernel: str  # the kernel contributing most of this class's measured time ("" if none)

    @property
    def excess_s(self) -> float:
        return self.measured_s - self.ideal_s


@dataclass(frozen=True)
class KernelRow:
    name: str
    ops: tuple[OpClass, ...]
    time_s: float  # per step
    launches: float  # per step


@dataclass(frozen=True)
class KernelFactor:
    factor: float  # measured_s / ideal_s
    measured_s: float  # profiled kernel time per step
    ideal_s: float  # roofline ideal per step
    launches: float  # kernel launches per step
    launch_latency_s: float
    launch_overhead_s: float  # launches x launch latency, reported beside the factor
    tokens: int  # tokens per profiled forward
    context: int  # cached keys the ideal assumes
    op_gaps: tuple[OpGap, ...]  # largest excess time first
    kernels: tuple[KernelRow, ...]  # most time first


def kernel_factor(kernel_traces: Sequence[KernelTrace], shape: CostShape, tokens: int, context: int,
                  ceilings: Ceilings, weight_bytes: float = 2.0, act_bytes: int = 2,
                  launch_latency_s: float = DEFAULT_LAUNCH_LATENCY_S) -> KernelFactor:
    """Profiled device time per step over the ideal, with per-op-class gaps and launch counts.

    A kernel that several op classes share (a generic GEMM) has its time split across them in proportion
    to their ideal bytes: decode-width linears are bandwidth-bound, so bytes are what their time follows.
    """
    if not kernel_traces:
        raise ValueError("no kernel traces to attribute")
    if launch_latency_s < 0.0:
        raise ValueError(f"launch_latency_s={launch_latency_s}: must be >= 0")
    widths = {k.tokens for k in kernel_traces}
    if widths != {tokens}:
        raise ValueError(f"kernel traces were profiled at {sorted(widths)} tokens per forward, ideal asked for {tokens}")
    ideals = ideal_op_times(shape, tokens, context, ceilings, weight_bytes, act_bytes)
    measured = {op: 0.0 for op in OpClass}
    top: dict[OpClass, tuple[float, str]] = {}
    rows = []
    for trace in kernel_traces:
        if trace.steps <= 0:
            raise ValueError(f"kernel {trace.name!r}: steps={trace.steps} must be > 0")
        per_step = trace.device_s / trace.steps
        ops = kernel_op_classes(trace.name, trace.op)
        rows.append(KernelRow(trace.name, ops, per_step, trace.calls / trace.steps))
        weights = [ideals[op].bytes if op in ideals else 0.0 for op in ops]
        total_weight = sum(weights)
        for op, weight in zip(ops, weights):
            share = per_step * (weight / total_weight if total_weight > 0.0 else 1.0 / len(ops))
            measured[op] += share
            if share > top.get(op, (-1.0, ""))[0]:
                top[op] = (share, trace.name)
    gaps = []
    for op in OpClass:
        ideal = ideals.get(op)
        if ideal is None and measured[op] == 0.0:
            continue
        ideal_s = ideal.ideal_s if ideal else 0.0
        gaps.append(OpGap(op, measured[op], ideal_s, ideal.bound if ideal else Bound.UNMODELLED,
                          measured[op] / ideal_s if ideal_s > 0.0 else None, top.get(op, (0.0, ""))[1]))
    measured_s = sum(r.time_s for r in rows)  # the kernels' own times: the op-class split rounds by the formats' bytes
    ideal_s = sum(i.ideal_s for i in ideals.values())
    launches = sum(r.launches for r in rows)
    return KernelFactor(
        factor=measured_s / ideal_s, measured_s=measured_s, ideal_s=ideal_s, launches=launches,
        launch_latency_s=launch_latency_s, launch_overhead_s=launches * launch_latency_s,
        tokens=tokens, context=context,
        op_gaps=tuple(sorted(gaps, key=lambda g: -g.excess_s)),
        kernels=tuple(sorted(rows, key=lambda r: -r.time_s)),
    )
