"""The cyclic garbage collector paused for a decode loop (and for a CUDA-graph capture).

A full collection walks every live object; a bench or a server holding thousands of requests' step traces has
millions, so one collection landing inside a decode loop stalls it by 0.1-0.5 s (seen on the H200: one request's
steps averaged 11 ms instead of 1 ms). The loops create few reference cycles, so nothing leaks meanwhile: the
garbage waits for the next collection after the loop. A capture must not see a collection either: one that
frees an unreachable CUDA graph mid-capture invalidates the capture (kernels/_common.capture_graph).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Disables the collector inside the block and restores its previous state (nested blocks keep it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
