"""Ask L2 for the first lines of every row of a weight matrix, from a side stream, while the step waits on latency.

At Llama-3-8B shapes the attention of a decode step reads almost nothing (its KV at short contexts is < 1 MB) yet
takes ~6 us of split + combine latency, during which HBM idles; the o_proj launch after it then streams its 33.5 MB
from HBM in one wave. A side stream forked before the attention can fill L2 with o_proj's first K chunks
meanwhile (`prefetch.global.L2`: no data returned to the SM, no register, nothing waits on it), so o_proj's first
chunks come from L2. Weights are never written during a step, so reading them early is safe, and a prefetch is a
hint: it changes no value anywhere (the engine's bits are the same with it or without).

PDL's per-program prefetch (kernels/pdl.py) did this from inside the successor and lost at these shapes: its
programs occupy SM slots while the predecessor runs. This launch is a handful of short programs that exit once
their requests are issued.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_int, check_launchable, check_tensor

LINE_BYTES = 128
PREFETCH_ROWS = 64  # rows a program asks for (LINES lines each)


@triton.jit
def _l2_prefetch_kernel(w_ptr, N, K, ROWS: tl.constexpr, LINES: tl.constexpr, STEP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.minimum(tl.arange(0, LINES) * STEP, K - 1)
    ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K + offs[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def l2_prefetch(w: torch.Tensor, lines: int) -> None:
    """Asks L2 for the first `lines` 128-byte lines of each row of w [N, K] (contiguous, on a GPU); lines past a
    row's end ask for its last element. lines: a power of two, 1..1024. Returns at once (the requests are
    asynchronous). On a CPU tensor it does nothing: there is no L2 to ask, and no value depends on it."""
    check_tensor("w", w, (None, None))
    check_int("lines", lines, 1, 1024)
    if lines & (lines - 1):
        raise ValueError(f"lines={lines} must be a power of two")
    if w.device.type != "cuda":
        return
    check_launchable(_l2_prefetch_kernel, w.device)
    N, K = w.shape
    step = LINE_BYTES // w.element_size()
    _l2_prefetch_kernel[(triton.cdiv(N, PREFETCH_ROWS),)](w, N, K, ROWS=PREFETCH_ROWS, LINES=lines, STEP=step,
                                                          num_warps=4)


def prefetch_bytes(w: torch.Tensor, lines: int) -> int:
    """What l2_prefetch(w, lines) asks L2 for, in bytes (distinct lines only)."""
    n, k = w.shape
    return n * min(lines, triton.cdiv(k * w.element_size(), LINE_BYTES)) * LINE_BYTES
