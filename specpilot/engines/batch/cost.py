"""The target forward's cost curve (seconds vs tokens in the forward) and how to measure it on a runner.

The batching mechanisms price verify tokens with it: at small token counts a forward is launch- and
weight-bandwidth-bound and an extra token is nearly free; past the point where the GEMMs turn
compute-bound every token costs. The curve is a profiled table (BatchConfig.cost_curve, e.g. from a GPU
profile), or measured here on the runner itself (CPU included: there it costs a few forwards).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CostCurve:
    points: tuple[tuple[int, float], ...]  # (tokens, seconds), tokens strictly ascending, >= 2 points

    def __post_init__(self) -> None:
        points = tuple((int(n), float(s)) for n, s in self.points)
        tokens = [n for n, _ in points]
        if len(tokens) < 2 or any(a >= b for a, b in zip(tokens, tokens[1:])) or any(s <= 0 for _, s in points):
            raise ValueError(f"cost curve {self.points}: need >= 2 points, tokens ascending, seconds > 0")
        object.__setattr__(self, "points", points)
        x, y = np.array(tokens, float), np.array([s for _, s in points], float)
        # cached: the mechanisms read the curve every step
        object.__setattr__(self, "_x", x)
        object.__setattr__(self, "_y", y)
        object.__setattr__(self, "_last_slope", max(0.0, (y[-1] - y[-2]) / (x[-1] - x[-2])))
        object.__setattr__(self, "_memo", {})  # token count -> seconds: steps ask for the same few counts

    def at(self, tokens) -> np.ndarray | float:
        """Seconds of a forward of `tokens` tokens (scalar or array): piecewise linear, extended past the last
        point with the last segment's slope (never below the first point: a forward has a floor)."""
        if isinstance(tokens, (int, float)):
            seconds = self._memo.get(tokens)
            if seconds is None:
                seconds = self._at_scalar(float(tokens))
                if len(self._memo) < 1 << 16:
                    self._memo[tokens] = seconds
            return seconds
        x, y = self._x, self._y
        t = np.asarray(tokens, dtype=float)
        out = np.where(t <= x[-1], np.interp(t, x, y), y[-1] + (t - x[-1]) * self._last_slope)
        return float(out) if out.ndim == 0 else out

    def _at_scalar(self, t: float) -> float:
        """at() for one number in plain floats, the same operations as np.interp's (the mechanisms read the curve
        several times a step: numpy's per-call overhead was ~10 us of it on the CPU)."""
        pts = self.points
        if t >= pts[-1][0]:
            return pts[-1][1] + (t - pts[-1][0]) * self._last_slope
        if t <= pts[0][0]:
            return pts[0][1]
        j = bisect.bisect_right(pts, (t, math.inf)) - 1  # pts[j][0] <= t < pts[j + 1][0]
        (x0, y0), (x1, y1) = pts[j], pts[j + 1]
        return y0 if t == x0 else (y1 - y0) / (x1 - x0) * (t - x0) + y0

    def slope(self, tokens: float) -> float:
        """Marginal seconds per extra token around `tokens` (>= 0)."""
        return max(0.0, float(self.at(tokens + 8) - self.at(tokens)) / 8)

    def to_table(self) -> tuple[tuple[int, float], ...]:
        return tuple(self.points)


def profile_tokens(max_batch: int, block: int) -> list[int]:
    """Token counts worth timing: one token, whole 16-token tiles up to a full batch of full blocks."""
    top = max(2, max_batch * block)
    pts = {1, top}
    n = 16
    while n < top:
        pts.add(n)
        n *= 2
    return sorted(pts)


@torch.no_grad()
def measure_cost_curve(runner, tokens: list[int] | None = None, context: int = 256, repeats: int = 3) -> CostCurve:
    """Times the runner's forward at each token count, spread over as many request rows as it has (a batch of
    verify blocks at `context` keys each), best of `repeats` after one warm-up. Needs an idle runner: it
    borrows rows 0.. and free pages and gives them back."""
    from specpilot.engines.batch.runner import StepEntry

    tokens = tokens or profile_tokens(runner.B, runner.W)
    rows = min(runner.B, max(tokens))
    context = min(context, runner.cfg.max_seq_len - runner.W - 1)
    pages = [runner.cache.allocate(context + runner.W) for _ in range(rows)]
    try:
        for r, p in enumerate(pages):
            runner.bind(r, p)
        points = []
        for n in tokens:
            b = min(rows, n)
            per = [n // b + (1 if i < n % b else 0) for i in range(b)]
            if max(per) > runner.W:
                raise ValueError(f"{n} tokens over {b} rows exceed the block width {runner.W}")
            entries = [StepEntry(i, [0] * k, context) for i, k in enumerate(per)]
            best = float("inf")
            for rep in range(repeats + 1):
                t0 = time.perf_counter()
                runner.launch(entries).result()
                if rep:  # the first run compiles / captures
                    best = min(best, time.perf_counter() - t0)
            points.append((n, best))
    finally:
        for r, p in enumerate(pages):
            runner.unbind(r)
            runner.cache.release(p)
    # Timing noise can make a larger forward look cheaper; the curve is made non-decreasing.
    out, floor = [], 0.0
    for n, s in points:
        floor = max(floor, s)
        out.append((n, floor))
    return CostCurve(tuple(out))
