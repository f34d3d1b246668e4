"""Clocks for the batched engine's run loop: wall time for benchmarks, step counts for exact tests.

Arrivals are given on the clock: with WallClock a request joins once its arrival time (seconds since the
run started) has passed, with StepClock once that many steps have run, so tests can make requests join at
chosen steps, deterministically.
"""
from __future__ import annotations

import math
import time
from typing import Protocol


class Clock(Protocol):
    def start(self) -> None: ...

    def now(self) -> float: ...

    def wait_until(self, t: float) -> None:
        """Nothing to do before t (the engine is idle): let time pass."""
        ...

    def tick(self) -> None:
        """A step ended."""
        ...


class WallClock:
    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)

    def tick(self) -> None:
        pass


class StepClock:
    """Time is the number of steps run so far; idling jumps to the next arrival."""

    def __init__(self) -> None:
        self.steps = 0

    def start(self) -> None:
        self.steps = 0

    def now(self) -> float:
        return float(self.steps)

    def wait_until(self, t: float) -> None:
        self.steps = max(self.steps, math.ceil(t))

    def tick(self) -> None:
        self.steps += 1
