"""Programmatic dependent launch (PDL, sm_90+): a kernel starts while its predecessor is still running.

In a decode step every kernel waits for the previous one to finish and then pays its own launch and first-load
latency: at SmolLM2 shapes that is most of a 2-7 us kernel. With PDL (the launch attribute plus the PTX
griddepcontrol instructions) the next kernel's programs are scheduled while the current one runs; they ask L2 for
their weight rows (weights are never written during a step, so reading them early is safe), then block in
`griddepcontrol.wait` until the predecessor has completed and its writes are visible, and only then read
activations or write anything. Arithmetic is untouched: the same bits either way.

Every kernel launched with the attribute executes the wait unconditionally, before any early exit: a PDL kernel
that completed without waiting could let a later, ordinary launch start before an earlier kernel finished.
Kernels launched without it (torch ops) keep plain stream order.

When the successor may launch is the trigger's place (GridDependency): right after the wait, or only once every
program has finished its main loop (`release_successor`, at the end of each PDL kernel's loop). A trigger is a
scheduling hint; the successor's wait still holds it until this kernel has completed, so the place changes no value.
"""
from __future__ import annotations

import contextlib
import enum
import functools

import torch
import triton
import triton.language as tl


class GridDependency(enum.IntEnum):
    """How the fused kernels overlap their predecessor (the kernels' PDL constexpr).

    Letting the successor launch before waiting (a chain of resident kernels, all prefetching) measured slower on
    an H200 (SmolLM2 1.44 vs 0.79 ms a step, Llama-3-8B 7.68 vs 5.17): no such mode."""

    OFF = 0  # plain stream order
    WAIT_THEN_TRIGGER = 1  # wait for the predecessor, then let the successor launch: two kernels in flight
    # Wait, and let the successor launch only when every program has finished its main loop: its launch and first
    # loads overlap this kernel's epilogues and tail, but its waiting programs take no SM slot while this kernel's
    # last wave still streams its weights (what mode 1 may cost the multi-wave Llama-3-8B GEMMs: notes/h200.md).
    WAIT_THEN_TRIGGER_AT_END = 2


# PDL only for launches whose weight matrix fits this (L2 is 50 MB on an H200), prefetched before their wait; a
# launch reading a larger one runs in plain stream order (or `large_mode`, prefetching the first lines of each row
# that fit this budget together: the whole first lines would overflow L2 at Llama-3-8B's gate_up). H200, the whole step: SmolLM2-135M (every matrix small
# but the LM head) 0.79-0.82 ms with PDL vs 1.05-1.07 without; Llama-3-8B (every matrix large) 6.78 ms with PDL and
# every matrix prefetched, 6.40-6.47 with PDL and none prefetched, 5.15-5.25 without PDL: the bandwidth-bound
# multi-wave GEMMs lose from overlap, the launch-bound small ones gain. Larger matrices take `large_mode` (default
# OFF, what those numbers chose) and are never prefetched.
PREFETCH_MAX_BYTES = 16 << 20
_state = {"mode": GridDependency.WAIT_THEN_TRIGGER, "prefetch_max_bytes": PREFETCH_MAX_BYTES,
          "large_mode": GridDependency.OFF}


@contextlib.contextmanager
def grid_dependency(mode: GridDependency, prefetch_max_bytes: int = PREFETCH_MAX_BYTES,
                    large_mode: GridDependency = GridDependency.OFF):
    """Launches (and graph captures) inside the block use `mode` on GPUs that support it, for weight matrices up to
    prefetch_max_bytes (prefetched), and `large_mode` for larger ones (not prefetched)."""
    for name, m in (("mode", mode), ("large_mode", large_mode)):
        if not isinstance(m, GridDependency):
            raise ValueError(f"{name} must be a GridDependency, got {m!r}")
    if isinstance(prefetch_max_bytes, bool) or not isinstance(prefetch_max_bytes, int) or prefetch_max_bytes < 0:
        raise ValueError(f"prefetch_max_bytes must be an int >= 0, got {prefetch_max_bytes!r}")
    saved = dict(_state)
    _state.update(mode=mode, prefetch_max_bytes=prefetch_max_bytes, large_mode=large_mode)
    try:
        yield
    finally:
        _state.update(saved)


def parse_grid_dependency(spec: str) -> dict:
    """grid_dependency's keywords from "MODE[:PREFETCH_MIB[:LARGE_MODE]]" (GridDependency names, any case; an empty
    field keeps its default), as the measurement scripts take them on their command lines."""
    mode, mib, large = (spec.split(":") + ["", ""])[:3]
    try:
        return {"mode": GridDependency[mode.upper()],
                "prefetch_max_bytes": int(mib) << 20 if mib else PREFETCH_MAX_BYTES,
                "large_mode": GridDependency[(large or "off").upper()]}
    except (KeyError, ValueError) as e:
        raise ValueError(f"grid dependency {spec!r}: expected MODE[:PREFETCH_MIB[:LARGE_MODE]] with modes in "
                         f"{[m.name.lower() for m in GridDependency]} ({e})") from None


@functools.lru_cache(maxsize=None)
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def check_launch_mode(value) -> None:
    """A kernel table's grid_dependency field: None (the policy of grid_dependency()) or a GridDependency value."""
    if value is not None and (isinstance(value, bool) or value not in tuple(GridDependency)):
        raise ValueError(f"grid_dependency={value!r} must be None or one of {[int(m) for m in GridDependency]}")


def pdl_launch(device: torch.device, weight_rows: int = 0, k: int = 0, elem_size: int = 2,
               mode: int | None = None) -> dict:
    """Launch keywords of a PDL-aware kernel on `device`: its PDL constexpr, the launch attribute when on, and for
    a kernel reading a weight matrix ([weight_rows, k] elements of elem_size bytes) its PF_LINES; a matrix over the
    prefetch budget takes the large-matrix mode and prefetches only the first lines of its rows that fit the budget.
    mode: this launch's GridDependency instead of that policy (a kernel table entry's grid_dependency). CPU tensors
    (the interpreter) and GPUs before sm_90 get OFF."""
    small = weight_rows * k * elem_size <= _state["prefetch_max_bytes"]
    if mode is None:
        mode = _state["mode"] if small else _state["large_mode"]
    else:
        check_launch_mode(mode)
        mode = GridDependency(mode)
    on = mode is not GridDependency.OFF and device.type == "cuda" and _supports_pdl(device.index or 0)
    kw = {"PDL": int(mode), "launch_pdl": True} if on else {"PDL": 0}
    if weight_rows:
        budget_lines = _state["prefetch_max_bytes"] // (weight_rows * 128)
        kw["PF_LINES"] = prefetch_lines(k, elem_size) if small else \
            prefetch_lines(k, elem_size, most=min(32, budget_lines)) if on and budget_lines else 0
    return kw


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """Blocks until the previous kernel in the stream has completed (its writes visible); in WAIT_THEN_TRIGGER lets
    the next launch."""
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def release_successor(PDL: tl.constexpr):
    """In WAIT_THEN_TRIGGER_AT_END, at the end of a program's main loop: the next launch may start once every
    program got here (or exited)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows(row_ptrs, K, PDL: tl.constexpr, LINES: tl.constexpr):
    """Asks L2 for the first LINES 128-byte lines of each row (row_ptrs [R] -> rows of K elements); only under
    PDL, where it overlaps the predecessor (LINES=0: none). A prefetch is a hint: it changes no value."""
    if PDL != 0 and LINES > 0:
        step: tl.constexpr = 128 // (row_ptrs.dtype.element_ty.primitive_bitwidth // 8)
        offs = tl.minimum(tl.arange(0, LINES) * step, K - 1)
        ptrs = row_ptrs[:, None] + offs[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def prefetch_lines(k: int, elem_size: int, most: int = 32) -> int:
    """LINES for rows of k elements: all of a row up to `most` lines (4 KiB), a power of two (`most` rounded down
    to one)."""
    most = 1 << (most.bit_length() - 1)
    return min(most, triton.next_power_of_2(triton.cdiv(k * elem_size, 128)))
