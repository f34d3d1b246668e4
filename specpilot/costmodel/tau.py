"""The tau factor: what the current draft trees accept versus what the best best-first tree would.

For every recorded step the best-first tree is rebuilt from the drafter's distributions at each candidate
node budget and replayed against the target's actual continuation. The budget with the best predicted
speedup (tokens per step over the verify step's cost) is the optimal tree shape; tau compares the tokens
per step the current system got with the tokens per step that shape would have got on the same steps.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from specpilot.costmodel.acceptance import best_first_tree, replay_prefix_accepted
from specpilot.engines.traces import StepTrace

DEFAULT_BUDGETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostCurve:
    """Verify-step cost against tokens in the forward, relative to a 1-token step, linear between points.

    Outside the measured range the nearest segment is extended: clamping would make trees larger than the
    largest measured one look free.
    """

    points: tuple[tuple[int, float], ...]  # (tokens in the forward, relative cost), sorted by tokens

    def __post_init__(self) -> None:
        if len(self.points) < 2:
            raise ValueError(f"a cost curve needs at least two measured points, got {len(self.points)}")
        xs = [x for x, _ in self.points]
        if xs != sorted(set(xs)):
            raise ValueError(f"cost curve token counts must be distinct and increasing: {xs}")
        for x, y in self.points:
            if x < 1 or not (math.isfinite(y) and y > 0.0):
                raise ValueError(f"cost curve point ({x}, {y}): need tokens >= 1 and a finite cost > 0")

    @classmethod
    def from_measured(cls, measured: Mapping[int, float]) -> "CostCurve":
        """Build from measured step times (seconds or relative); rescaled so a 1-token step costs 1."""
        raw = cls(tuple(sorted((int(x), float(y)) for x, y in measured.items())))
        one = raw._interpolate(1)
        if not one > 0.0:
            raise ValueError(f"cost curve {dict(measured)} extrapolates to {one} at 1 token; measure the 1-token step")
        return cls(tuple((x, y / one) for x, y in raw.points))

    def _interpolate(self, tokens: float) -> float:
        pts = self.points
        i = 1
        while i < len(pts) - 1 and tokens > pts[i][0]:
            i += 1
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def __call__(self, tokens: int) -> float:
        return self._interpolate(tokens)


CostCurveLike = Callable[[int], float] | Mapping[int, float]


def as_cost_curve(cost_curve: CostCurveLike) -> Callable[[int], float]:
    if isinstance(cost_curve, Mapping):
        return CostCurve.from_measured(cost_curve)
    return cost_curve


@dataclass(frozen=True)
class BudgetRow:
    budget: int  # draft nodes verified per step
    accepted_total: int  # tokens over all replayed steps, one bonus per step included
    tokens_per_step: float
    verify_cost: float  # cost_curve(budget + 1)
    predicted_speedup: float  # tokens_per_step / verify_cost


@dataclass(frozen=True)
class TauFactor:
    tau: float  # current_tokens_per_step / optimal_tokens_per_step
    best_budget: int
    current_tokens_per_step: float  # recorded accepted + 1 bonus, per step
    optimal_tokens_per_step: float  # best-first tree at best_budget, replayed, + 1 bonus, per step
    current_predicted_speedup: float  # current tokens over the cost of the verify widths it actually used
    optimal_predicted_speedup: float
    steps: int  # steps replayed
    skipped_steps: int  # steps without a recorded target continuation (cannot be replayed)
    rows: tuple[BudgetRow, ...]

    @property
    def gap(self) -> float:
        """How many times more tokens per step the optimal tree shape gets (>= 1 means room to gain)."""
        return 1.0 / self.tau


def _cost(curve: Callable[[int], float], tokens: int) -> float:
    cost = float(curve(tokens))
    if not (math.isfinite(cost) and cost > 0.0):
        raise ValueError(f"cost_curve({tokens}) = {cost}: must be a finite cost > 0")
    return cost


def tau_factor(steps: Sequence[StepTrace], cost_curve: CostCurveLike,
               budgets: Sequence[int] = DEFAULT_BUDGETS) -> TauFactor:
    """Replay every step at every budget, pick the budget of best predicted speedup, and compare.

    Both sides count accepted drafts + 1 bonus per step over the same replayable steps, so the ratio is
    not biased by end-of-request truncation (which hits both equally).
    """
    budgets = tuple(sorted(set(int(b) for b in budgets)))
    if not budgets or budgets[0] < 1:
        raise ValueError(f"budgets={budgets}: need at least one budget, all >= 1")
    curve = as_cost_curve(cost_curve)
    replayable = [s for s in steps if s.target_tokens]
    if not replayable:
        raise ValueError(f"none of the {len(steps)} steps has a recorded target continuation to replay against")
    largest = budgets[-1]
    totals = [0] * len(budgets)
    current_tokens = 0
    current_cost = 0.0
    for step in replayable:
        # The tree for budget b is the first b nodes of the largest one: build once, replay every prefix.
        tree = best_first_tree(step.topk_tokens, step.topk_probs, largest)
        accepted_at = replay_prefix_accepted(tree, step.target_tokens)
        for i, budget in enumerate(budgets):
            totals[i] += accepted_at[min(budget, len(tree))] + 1
        current_tokens += step.accepted + 1
        current_cost += _cost(curve, max(1, step.verify_tokens))
    n = len(replayable)
    rows = []
    for budget, total in zip(budgets, totals):
        cost = _cost(curve, budget + 1)
        rows.append(BudgetRow(budget, total, total / n, cost, total / n / cost))
    # Best predicted speedup; on a tie the smaller budget (same speed for less verify work).
    best = max(rows, key=lambda r: (r.predicted_speedup, -r.budget))
    current_per_step = current_tokens / n
    return TauFactor(
        tau=current_per_step / best.tokens_per_step, best_budget=best.budget,
        current_tokens_per_step=current_per_step, optimal_tokens_per_step=best.tokens_per_step,
        current_predicted_speedup=current_tokens / current_cost, optimal_predicted_speedup=best.predicted_speedup,
        steps=n, skipped_steps=len(steps) - n, rows=tuple(rows),
    )
