"""The geometric mean every speedup summary uses (benches, the tuning loop's stages, agents' trials, replays)."""
from __future__ import annotations

import math
from collections.abc import Iterable


def geomean(values: Iterable[float], empty: float = 0.0) -> float:
    """Geometric mean of positive values; `empty` when there are none. A value <= 0 is an error (a speedup of 0 is
    a run that did not happen: geomean_of_runs leaves those out)."""
    xs = list(values)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else empty


def geomean_of_runs(speedups: Iterable[float]) -> float:
    """The geometric mean over the runs that happened (speedup > 0); 0 when none did."""
    return geomean(v for v in speedups if v > 0)
