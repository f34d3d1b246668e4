"""The cost model: pure functions over profile traces that attribute the gap to the ceiling.

tau factor (draft tree shape, by exact replay), kernel factor (profiled vs roofline kernel time) and overhead
factor (wall vs kernel time); their product is the total gap, and the largest excess names the direction.
Used by stages/attribute; depends only on the engine's trace records and model shapes.
"""
from specpilot.costmodel.acceptance import (
    ROOT, Tree, best_first_tree, closed_form_speedup, expected_accepted, replay_accepted, replay_prefix_accepted,
)
from specpilot.costmodel.attribution import (
    Attribution, Direction, DirectionName, OverheadFactor, attribute, overhead_factor, rank_directions,
)
from specpilot.costmodel.classify import LINEAR_OPS, classify_kernel, kernel_op_classes
from specpilot.costmodel.kernel_factor import (
    BANDWIDTH_EFFICIENCY, DEFAULT_LAUNCH_LATENCY_S, FLOP_EFFICIENCY, Bound, Ceilings, KernelFactor, KernelRow,
    OpGap, OpIdeal, ideal_op_times, kernel_factor,
)
from specpilot.costmodel.report import plot, render_markdown
from specpilot.costmodel.tau import DEFAULT_BUDGETS, BudgetRow, CostCurve, TauFactor, tau_factor

__all__ = [
    "ROOT", "Tree", "best_first_tree", "closed_form_speedup", "expected_accepted", "replay_accepted",
    "replay_prefix_accepted",
    "Attribution", "Direction", "DirectionName", "OverheadFactor", "attribute", "overhead_factor", "rank_directions",
    "LINEAR_OPS", "classify_kernel", "kernel_op_classes",
    "BANDWIDTH_EFFICIENCY", "DEFAULT_LAUNCH_LATENCY_S", "FLOP_EFFICIENCY", "Bound", "Ceilings", "KernelFactor",
    "KernelRow", "OpGap", "OpIdeal", "ideal_op_times", "kernel_factor",
    "plot", "render_markdown",
    "DEFAULT_BUDGETS", "BudgetRow", "CostCurve", "TauFactor", "tau_factor",
]
