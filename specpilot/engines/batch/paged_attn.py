"""Causal attention of a batch of requests over a paged KV cache, with kernels.attn's per-row reduction order.

Each request r owns q_len[r] consecutive query tokens (from q_start[r]) that are its LAST q_len[r] logical
keys: token j sits at logical position kv_len[r] - q_len[r] + j and sees logical keys 0 .. its position (a chain
verify block, an AR token or a prefill chunk). Logical key i lives at physical slot
page_table[r, i // PAGE] * PAGE + i % PAGE of caches [kv_heads, S, D].

Why the bits equal kernels.attn.attention's for the same keys: the page size is attn's split_keys, so one
split is one page and a split covers the same absolute key range [s*PAGE, (s+1)*PAGE) as there; inside it the
key blocks of block_n start at the same absolute offsets; the per-block update (dot, mask, online softmax,
tl.dot row sums, where-guarded no-ops for blocks without a visible key) and the combine are the same functions
(attn.online_softmax_block, attn.combine_splits); both launch without FP fusion (NO_FP_FUSION).
Only addressing differs (a page lookup) and visibility is computed from positions instead of an anc matrix
(the same boolean for chains). Rows are (token, query head of the group) pairs of ONE request tiled by the
fixed ROW_TILE, and a row never depends on the other rows of its tile. ROW_TILE is 32 where the single-request
kernel's tiles are BLOCK_M = 16: each tile reads all of its request's keys, so a verify block of 6-10 tokens x 3
query heads (18-30 rows) takes one pass over the keys instead of two. Both compile to the same MMA v2 m16n8k16
dots (test_kernel_codegen: only the row count differs), each 16-row slab the same instructions in the same K
order, so the same bits; 64 rows would switch to wgmma.

Grid: (tile, kv head, group of SPLITS_PER_PROGRAM splits). The host lists each request's row tiles in
tile_req/tile_row (-1: no tile), so a CUDA graph can be captured once per token bucket with the largest tile
count and every page a request may hold; unused programs exit once their predecessor is done (they wait for it
first under programmatic dependent launch, kernels/pdl.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from specpilot.kernels._common import NO_FP_FUSION, check_launchable, check_out, check_tensor, dot_precision
from specpilot.kernels.attn import (LOG2E, SPLIT_GROUP, AttentionParams, check_qkv, combine_splits,
                                    online_softmax_block)
from specpilot.kernels.pdl import pdl_launch, release_successor, wait_for_predecessor

ATTN = AttentionParams()  # the default attention launch (an engine's kernel table may tune it: see model.py)
PAGE = ATTN.split_keys  # default page size == split_keys: one split of the reduction is one page
# Splits one program reduces in turn. A CUDA graph's grid covers every page a request may hold, and most of
# those programs have nothing to do; a few splits per program keeps that idle grid small. Changes no bit.
SPLITS_PER_PROGRAM = 4
ROW_TILE = 32  # (token, head) rows a program attends for (see above)


@triton.jit(do_not_specialize=["NTOK"])
def _paged_split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, tile_req_ptr, tile_row_ptr, qstart_ptr, qlen_ptr, kvlen_ptr,
                        ws_m_ptr, ws_l_ptr, ws_o_ptr, NTOK, S, P, qk_scale, H: tl.constexpr, G: tl.constexpr,
                        D: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLIT: tl.constexpr, SPLITS_PER_PROGRAM: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # before the early exits below (kernels/pdl.py): q and the new keys come from QKV
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.program_id(2) * SPLITS_PER_PROGRAM
    req = tl.load(tile_req_ptr + tile)
    if req >= 0:
        T = tl.load(qlen_ptr + req).to(tl.int32)
        end = tl.load(kvlen_ptr + req).to(tl.int32)  # this request's keys: 0 .. end-1
        n_split = tl.cdiv(end, SPLIT)
        if first < n_split:
            dtype = q_ptr.dtype.element_ty
            r = tl.load(tile_row_ptr + tile).to(tl.int32) + tl.arange(0, BLOCK_M)
            row_ok = r < T * G
            t = r // G
            h = kvh * G + r % G
            qpos = end - T + t  # logical position of each row's token: it sees keys 0 .. qpos
            tok = tl.load(qstart_ptr + req) + t
            dd = tl.arange(0, D)
            q = tl.load(q_ptr + (tok * H + h).to(tl.int64)[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
            ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(dtype)
            kv_base = kvh.to(tl.int64) * S * D
            # Several splits per program (fewer idle programs in a graph's fixed grid); each split's partial
            # result is computed from scratch and stored on its own, exactly as one program per split would.
            # With one key block a split (SPLIT == BLOCK_N) this loop is the innermost one, so the compiler
            # pipelines it: the next split's page entry and keys load while this one computes.
            for split in range(first, tl.minimum(first + SPLITS_PER_PROGRAM, n_split)):
                _split_partial(q, k_ptr, v_ptr, pt_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, req, split, end, P, S, kv_base,
                               dd, row_ok, qpos, tok, h, ones, qk_scale, NTOK, H, D, DOT_PREC, BLOCK_M, BLOCK_N,
                               SPLIT, SPLIT == BLOCK_N)
    release_successor(PDL)


@triton.jit
def _split_partial(q, k_ptr, v_ptr, pt_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, req, split, end, P, S, kv_base, dd,
                   row_ok, qpos, tok, h, ones, qk_scale, NTOK, H: tl.constexpr, D: tl.constexpr,
                   DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   ONE_BLOCK: tl.constexpr):
    """One split's (max, sum, unnormalised output) of a tile's rows, stored: its key blocks in order (ONE_BLOCK:
    exactly one, as split < the request's split count, and no loop)."""
    lo = split * SPLIT
    page = tl.load(pt_ptr + req * P + split)
    page_ok = (page >= 0) & ((page + 1) * SPLIT <= S)  # a bad table entry reads nothing
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if ONE_BLOCK:
        m, l, acc = _key_block(q, k_ptr, v_ptr, lo, lo, end, page, page_ok, kv_base, dd, row_ok, qpos, ones, m, l,
                               acc, qk_scale, D, DOT_PREC, BLOCK_N, SPLIT)
    else:
        for k0 in range(lo, tl.minimum(lo + SPLIT, end), BLOCK_N):
            m, l, acc = _key_block(q, k_ptr, v_ptr, k0, lo, end, page, page_ok, kv_base, dd, row_ok, qpos, ones, m,
                                   l, acc, qk_scale, D, DOT_PREC, BLOCK_N, SPLIT)
    w = (split * (NTOK * H) + tok * H + h).to(tl.int64)
    tl.store(ws_m_ptr + w, m, mask=row_ok)
    tl.store(ws_l_ptr + w, l, mask=row_ok)
    tl.store(ws_o_ptr + w[:, None] * D + dd[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _key_block(q, k_ptr, v_ptr, k0, lo, end, page, page_ok, kv_base, dd, row_ok, qpos, ones, m, l, acc, qk_scale,
               D: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    kk = k0 + tl.arange(0, BLOCK_N)
    k_ok = (kk < end) & page_ok
    ks = page * SPLIT + (kk - lo)  # physical slot of logical key kk
    kt = tl.load(k_ptr + kv_base + ks.to(tl.int64)[None, :] * D + dd[:, None], mask=k_ok[None, :], other=0.0)
    vis = row_ok[:, None] & (k_ok[None, :] & (kk[None, :] <= qpos[:, None]))
    v = tl.load(v_ptr + kv_base + ks.to(tl.int64)[:, None] * D + dd[None, :], mask=k_ok[:, None], other=0.0)
    return online_softmax_block(q, kt, v, vis, ones, m, l, acc, qk_scale, DOT_PREC)


@triton.jit(do_not_specialize=["NTOK"])
def _paged_combine_kernel(ws_m_ptr, ws_l_ptr, ws_o_ptr, o_ptr, tok_kvlen_ptr, NTOK, H: tl.constexpr,
                          D: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)
    row = tl.program_id(0)  # row = token * H + head, one per program
    kvlen = tl.load(tok_kvlen_ptr + row // H)  # 0: a padding token, no split
    n_split = ((kvlen + SPLIT - 1) // SPLIT).to(tl.int32)
    acc, l = combine_splits(ws_m_ptr, ws_l_ptr, ws_o_ptr, row, NTOK * H, n_split, D, GROUP)
    release_successor(PDL)
    out = acc / tl.where(l > 0, l, 1.0)  # padding tokens: 0 / 1
    dd = tl.arange(0, D)
    tl.store(o_ptr + row.to(tl.int64) * D + dd, out.to(o_ptr.dtype.element_ty))


@dataclass(frozen=True)
class PagedMeta:
    """Where each request's tokens and keys are (int64 device tensors; B request rows, P pages per request).

    page_table [B, P]; q_start, q_len, kv_len [B] (q_len 0: the row is not in this step); tile_req, tile_row
    [n_tiles] (tile_req -1: unused program); tok_kv_len [NTOK] (the kv_len of each token's request, 0 for
    padding tokens). tile_map() builds the tile lists on the host."""

    page_table: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    kv_len: torch.Tensor
    tile_req: torch.Tensor
    tile_row: torch.Tensor
    tok_kv_len: torch.Tensor


def tile_map(q_len: np.ndarray, group: int, n_tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """(tile_req, tile_row) [n_tiles]: request r's rows (q_len[r] * group) in ROW_TILE tiles, rest -1 / 0."""
    per = _tiles_per_request(q_len, group)
    total = int(per.sum())
    if total > n_tiles:
        raise ValueError(f"{total} row tiles do not fit the {n_tiles} the call has room for")
    req = np.full(n_tiles, -1, dtype=np.int64)
    row = np.zeros(n_tiles, dtype=np.int64)
    req[:total] = np.repeat(np.arange(len(q_len)), per)
    first = np.repeat(np.cumsum(per) - per, per)
    row[:total] = (np.arange(total) - first) * ROW_TILE
    return req, row


def max_tiles(tokens: int, group: int, requests: int) -> int:
    """Row tiles a step of `tokens` tokens over at most `requests` requests can need: each request's rows start a
    tile of their own, and a step has no more requests than tokens (a CUDA graph of a small token bucket then
    launches attention over a few tiles, not one per request row of the runner)."""
    return -(-tokens * group // ROW_TILE) + min(requests, tokens)


def _tiles_per_request(q_len: np.ndarray, group: int) -> np.ndarray:
    return -(-q_len * group // ROW_TILE)


def tiles_for(q_len: np.ndarray, group: int) -> int:
    """Row tiles the requests' rows take (tile_map's count)."""
    return int(_tiles_per_request(q_len, group).sum())


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta,
                        page: int = PAGE) -> torch.Tensor:
    """Plain torch, request by request: fp32 scores and softmax over the logical keys; o [NTOK, H * D]
    (rows of tokens outside every request are 0)."""
    NTOK, H, D = q.shape
    KVH = k_cache.shape[0]
    out = torch.zeros(NTOK, H * D, dtype=q.dtype, device=q.device)
    for r in range(meta.q_len.shape[0]):
        T, end, qs = int(meta.q_len[r]), int(meta.kv_len[r]), int(meta.q_start[r])
        if T == 0:
            continue
        keys = torch.arange(end, device=q.device)
        slots = meta.page_table[r, keys // page] * page + keys % page
        k = k_cache[:, slots].float().repeat_interleave(H // KVH, dim=0)  # [H, end, D]
        v = v_cache[:, slots].float().repeat_interleave(H // KVH, dim=0)
        scores = torch.einsum("thd,hld->htl", q[qs:qs + T].float(), k) / math.sqrt(D)
        qpos = end - T + torch.arange(T, device=q.device)
        scores = scores.masked_fill(keys[None, None, :] > qpos[None, :, None], float("-inf"))
        o = torch.einsum("htl,hld->thd", torch.softmax(scores, dim=-1), v)
        out[qs:qs + T] = o.reshape(T, H * D).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta, *,
                    out: torch.Tensor | None = None, params: AttentionParams = ATTN,
                    max_kv_len: int | None = None) -> torch.Tensor:
    """o [NTOK, heads * D] for q [NTOK, heads, D] and caches [kv_heads, S, D] (S a multiple of the page size
    params.split_keys). Never syncs with the host: everything the kernels index by is read on the device.
    max_kv_len: a bound on kv_len the host knows (eager calls launch only the splits it needs); None: every
    page of the table (CUDA graphs, where the grid is fixed at capture)."""
    NTOK, H, D, KVH, S = check_qkv(q, k_cache, v_cache)
    dev, dt = q.device, q.dtype
    page = params.split_keys
    if S % page:
        raise ValueError(f"cache slots ({S}) must be a whole number of pages of {page}")
    check_tensor("meta.page_table", meta.page_table, (None, None), torch.int64, dev)
    B, P = meta.page_table.shape
    for name in ("q_start", "q_len", "kv_len"):
        check_tensor(f"meta.{name}", getattr(meta, name), (B,), torch.int64, dev)
    check_tensor("meta.tile_req", meta.tile_req, (None,), torch.int64, dev)
    n_tiles = meta.tile_req.shape[0]
    check_tensor("meta.tile_row", meta.tile_row, (n_tiles,), torch.int64, dev)
    check_tensor("meta.tok_kv_len", meta.tok_kv_len, (NTOK,), torch.int64, dev)
    check_launchable(_paged_split_kernel, dev)
    out = check_out("out", out, (NTOK, H * D), dt, dev)
    ws_m = torch.empty(P * NTOK * H, dtype=torch.float32, device=dev)
    ws_l = torch.empty_like(ws_m)
    ws_o = torch.empty(P * NTOK * H * D, dtype=torch.float32, device=dev)
    n_split = P if max_kv_len is None else max(1, min(P, -(-max_kv_len // page)))
    if n_tiles:
        _paged_split_kernel[(n_tiles, KVH, triton.cdiv(n_split, SPLITS_PER_PROGRAM))](
            q, k_cache, v_cache, meta.page_table, meta.tile_req, meta.tile_row, meta.q_start, meta.q_len,
            meta.kv_len, ws_m, ws_l, ws_o, NTOK, S, P, LOG2E / math.sqrt(D), H=H, G=H // KVH, D=D,
            DOT_PREC=dot_precision(dt), BLOCK_M=ROW_TILE, BLOCK_N=params.block_n, SPLIT=page,
            SPLITS_PER_PROGRAM=SPLITS_PER_PROGRAM, num_warps=params.num_warps, num_stages=params.num_stages,
            **NO_FP_FUSION, **pdl_launch(dev))
    _paged_combine_kernel[(NTOK * H,)](
        ws_m, ws_l, ws_o, out, meta.tok_kv_len, NTOK, H=H, D=D, SPLIT=page, GROUP=SPLIT_GROUP, num_warps=4,
        **NO_FP_FUSION, **pdl_launch(dev))
    return out
