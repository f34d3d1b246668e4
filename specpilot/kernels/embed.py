"""Embedding rows gathered by token id: one program a token, a plain copy (the bits of F.embedding).

Why not F.embedding inside the captured step: for at most 16 ids torch's CUDA index_select takes its small-index
kernel, whose every thread walks the ids one after another (a dependent load each), ~8 us for a 16-row verify on
an H100 against ~1.8 us for one id (notes/h200.md, session 49); from 17 ids on it takes a vectorized gather (~1.8
us). This kernel copies each row in its own program, and waits for its predecessor with PDL (the ids come from the
kernel before it), so its launch overlaps that kernel's tail like the projections' do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import ACT_DTYPES, check_launchable, check_out, check_tensor
from .pdl import pdl_launch, release_successor, wait_for_predecessor


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, V, H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # the ids are the previous kernel's output
    t = tl.program_id(0)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    ok = (tok >= 0) & (tok < V)  # an id out of range reads nothing and writes zeros (no device assert in a graph)
    cols = tl.arange(0, BLOCK)
    for c0 in tl.static_range(0, H, BLOCK):
        c = c0 + cols
        row = tl.load(w_ptr + tl.where(ok, tok, 0) * H + c, mask=(c < H) & ok, other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * H + c, row, mask=c < H)
    release_successor(PDL)


def _check(ids: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    check_tensor("weight", weight, (None, None), ACT_DTYPES)
    check_tensor("ids", ids, (None,), (torch.int32, torch.int64), weight.device)
    if ids.shape[0] < 1:
        raise ValueError("ids must hold at least one token")
    return ids.shape[0], weight.shape[0], weight.shape[1]


def embedding(ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight[ids] -> [T, H] for ids [T] (int32/int64 on weight's device) and weight [V, H] contiguous. Ids are not
    checked on the device (no host sync): one outside 0..V-1 gives a row of zeros. out: a [T, H] row-major buffer of
    weight's dtype (e.g. a view of a persistent one)."""
    T, V, H = _check(ids, weight)
    check_launchable(_embedding_kernel, weight.device)
    out = check_out("out", out, (T, H), weight.dtype, weight.device)
    block = min(triton.next_power_of_2(H), 1024)
    _embedding_kernel[(T,)](ids, weight, out, V, H=H, BLOCK=block, num_warps=4 if block >= 512 else 1,
                            **pdl_launch(weight.device))
    return out


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain torch (F.embedding), for ids in range."""
    _check(ids, weight)
    return F.embedding(ids, weight)
