"""Batch-invariant attention of T new tokens (a chain or a tree) over the KV cache, split over fixed key ranges.

Visibility, for chains and trees alike: every slot < base (the committed context) is visible to every query;
block token j sits at slot base + j and is visible to query i iff anc[i, j] (ancestor-or-self, so the diagonal
must be set). GQA: query head h reads KV head h // (heads / kv_heads). Scale 1/sqrt(D), softmax in fp32.
Only keys 0 .. base+T-1 are read.

Algorithm (flash-decoding): pass 1 runs an online softmax over each fixed absolute key range
[s*split_keys, (s+1)*split_keys) in key blocks of block_n, one program per (token-row tile, kv head, split),
and stores (max, sum, unnormalised output); pass 2 combines the splits of each row (combine_splits: groups of
SPLIT_GROUP splits read at once, a fixed order within and across groups).
Rows are (token, query head of the group) pairs tiled by the fixed BLOCK_M (or 32 rows: tile_rows, the same bits).

Invariance: key blocks and splits are absolute slot ranges (independent of T), the row max is exact in any
order, the row sums are `tl.dot`s (p @ V and p @ ones, fixed per-element order), and a key block (or split)
with no visible key for a row is an exact no-op for that row (guarded by a per-row `where`: m, l and acc keep
their bits), so a row's result does not depend on how many extra masked blocks or splits a call iterates, nor
on the other rows. `block_n` and `split_keys` fix the reduction order: tune them per model, never per T.
`base` may be a one-element int tensor on the device (for CUDA graphs: nothing then depends on its value on
the host); the grid then covers every split of the cache and the splits past base+T exit at once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ._common import (ACT_DTYPES, BLOCK_M, MMA_TILE_ROWS, NO_FP_FUSION, LaunchParams, check_int, check_launchable,
                      check_out, check_tensor, dot_precision)
from .pdl import pdl_launch, release_successor, wait_for_predecessor

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class AttentionParams(LaunchParams):
    """block_n and split_keys set the reduction order (per model, not per T); the others are T-neutral. The
    defaults are the engine's (one 64-key block per split: on an H200 at SmolLM2 shapes 1.867 vs 1.928 ms per step
    with 256-key splits, ctx ~600), so the kernel tuner starts from what the engine runs."""

    block_n: int = 64
    split_keys: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Row tiles one split program runs one after another (the same statements per tile, so the same bits): fewer
    # programs re-reading one split's keys when a verify's rows span several tiles (T * group > BLOCK_M).
    tiles_per_program: int = 1
    # (token, head) rows per tile: 32 rows read each key block once for two 16-row slabs, whose dots compile to
    # the same MMA v2 instructions as a 16-row tile's (tests/test_kernel_codegen.py; the paged kernel's 32-row
    # tiles gave the 16-row bits on an H200, session 18): T-neutral. 64 rows would take wgmma: other bits.
    tile_rows: int = BLOCK_M
    # num_stages of launches with block_slots (position-ordered attention): one 64-key block a split leaves nothing to
    # pipeline, and one stage compiles to 99 registers a thread against 168 (scripts/attn_registers.py). On the H200
    # (session 39, real SmolLM2, 40 requests) the 16-row tree's verify step 0.938 -> 0.893 ms, the 32-row one's
    # 1.126 -> 1.055; launches without block_slots (chains, AR) lose ~2% at one stage and keep num_stages. Not in
    # the search space: the tuner's attention microbench (kernels/bench.py) launches without block_slots.
    slot_stages: int = 1
    T_NEUTRAL: ClassVar[tuple[str, ...]] = ("num_warps", "num_stages", "tiles_per_program", "tile_rows",
                                            "slot_stages")
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"block_n": (32, 64, 128), "split_keys": (64, 128, 256, 512),
                                                "num_warps": (2, 4, 8), "num_stages": (1, 2, 3),
                                                "tiles_per_program": (1, 2, 4), "tile_rows": MMA_TILE_ROWS}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.split_keys % self.block_n:
            raise ValueError(f"split_keys={self.split_keys} must be a multiple of block_n={self.block_n}")
        if self.tiles_per_program not in (1, 2, 4, 8):
            raise ValueError(f"tiles_per_program={self.tiles_per_program} must be 1, 2, 4 or 8")
        check_int("slot_stages", self.slot_stages, 1)


@triton.jit
def _load_base(base_ptr, base_val, BASE_IS_PTR: tl.constexpr):
    if BASE_IS_PTR:
        b = tl.load(base_ptr).to(tl.int32)
    else:
        b = base_val
    return b


@triton.jit
def online_softmax_block(q, kt, v, vis, ones, m, l, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One key block's online-softmax update of (m, l, acc), shared by the single-request and paged split
    kernels so both run the same statements (the same statements are not enough on their own: the dots' operand
    layouts must match too, see the ancestor-mask load in _attn_split_kernel and tests/test_kernel_codegen.py).
    p @ V accumulates into acc * alpha inside the tl.dot, so the form of that sum is explicit, not the compiler's."""
    s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    live = m_new > float("-inf")  # rows with a visible key so far
    seen = tl.max(vis.to(tl.int32), axis=1) > 0  # rows with a visible key in this block
    m_safe = tl.where(live, m_new, 0.0)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None]).to(v.dtype)
    acc_new = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PREC)
    psum = tl.max(tl.dot(p, ones, input_precision=DOT_PREC), axis=1)  # 16 identical columns
    acc = tl.where(seen[:, None], acc_new, acc)
    l = tl.where(seen, l * alpha + psum, l)
    m = tl.where(seen, m_new, m)
    return m, l, acc


@triton.jit(do_not_specialize=["T", "base_val", "window"])
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, anc_ptr, base_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, bslot_ptr,
                       T, base_val, S, A, P_CTX, P_BLK, N_BLK, qk_scale, window, H: tl.constexpr, G: tl.constexpr,
                       D: tl.constexpr, BASE_IS_PTR: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr, TILES: tl.constexpr,
                       WINDOWED: tl.constexpr = False, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)  # before the early exit below (kernels/pdl.py): q and the new keys come from QKV
    kvh = tl.program_id(1)
    base = _load_base(base_ptr, base_val, BASE_IS_PTR)
    end = tl.minimum(base + T, S)  # keys 0..end-1 exist; the clamp only guards memory against a bad base
    if HAS_SLOTS:
        # One flat axis, two sections (attention(): the grid): first N_BLK programs, P_BLK per-token ones for each
        # split from the one holding base on (as many as a T-token block can reach), then P_CTX row-tile programs
        # for each split, which run only splits of context keys. The per-token programs go first (programs start
        # in index order and theirs read the most keys; no measurable change on the H200). A 3-D grid of per-token
        # programs for every split of the cache launched ~5x the programs, nearly all idle: ~2.5 us a layer on an
        # H200 (session 36: a 16-row tree's verify 1.036 -> 0.959 ms a step).
        pid = tl.program_id(0)
        in_blk = pid < N_BLK
        rest = pid - N_BLK
        split = tl.where(in_blk, base // SPLIT + pid // P_BLK, rest // P_CTX)
        prog_m = tl.where(in_blk, pid % P_BLK, rest % P_CTX)
        section_ok = in_blk | (split * SPLIT + SPLIT <= base)
    else:
        split = tl.program_id(2)
        prog_m = tl.program_id(0)
        section_ok = True
    part = split  # the split's place in the workspace
    if WINDOWED:  # the grid spans the window's splits only (attention(): its grid), counted from the first one
        split += tl.maximum(base - window, 0) // SPLIT
    lo = split * SPLIT
    for tile in tl.static_range(TILES):
        _attn_split_tile(q_ptr, k_ptr, v_ptr, anc_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, bslot_ptr,
                         prog_m * TILES + tile, kvh, part, base, end, lo, section_ok, T, S, A, qk_scale, window, H,
                         G, D, DOT_PREC, BLOCK_M, BLOCK_N, SPLIT, HAS_SLOTS, WINDOWED)
    release_successor(PDL)


@triton.jit
def _attn_split_tile(q_ptr, k_ptr, v_ptr, anc_ptr, ws_m_ptr, ws_l_ptr, ws_o_ptr, bslot_ptr, pid_m, kvh, part,
                     base, end, lo, section_ok, T, S, A, qk_scale, window, H: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr, WINDOWED: tl.constexpr):
    """Row tile pid_m of one (kv head, split from lo): the online softmax over the split's visible keys, its
    partials stored in workspace split `part`. A tile past the rows (the last program's spare tiles), or of a split
    its section does not run, does nothing. WINDOWED: context keys below base - window are not visible; the key loop
    starts at the window's first key block."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if HAS_SLOTS:
        # A split of context keys only (all below base) reads the same keys for every token: its rows are tiled
        # as without slots (the programs past those tiles exit). Splits reaching base run one token per program
        # (its G query heads): the token's own key slots feed one tl.dot. A row's result does not depend on the
        # tile it shares (the batch invariance AR == chain verify rests on), so the bits are the per-token ones.
        context = lo + SPLIT <= base
        n_g = tl.cdiv(G, BLOCK_M)
        tok = pid_m // n_g
        g = (pid_m % n_g) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = tl.where(context, r < T * G, g < G)
        t = tl.where(context, r // G, tok)
        h = kvh * G + tl.where(context, r % G, g)
        live = section_ok & (lo < end) & tl.where(lo + SPLIT > base, tok < T, pid_m * BLOCK_M < T * G)
    else:
        row_ok = r < T * G
        t = r // G
        h = kvh * G + r % G
        live = section_ok & (lo < end) & (pid_m * BLOCK_M < T * G)
    if live:
        dtype = q_ptr.dtype.element_ty
        dd = tl.arange(0, D)
        q = tl.load(q_ptr + (t * H + h).to(tl.int64)[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
        ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(dtype)
        kv_base = kvh.to(tl.int64) * S * D
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        first = lo
        if WINDOWED:
            first = tl.maximum(lo, (base - window) // BLOCK_N * BLOCK_N)
        for k0 in range(first, tl.minimum(lo + SPLIT, end), BLOCK_N):
            kk = k0 + tl.arange(0, BLOCK_N)
            k_ok = kk < end
            if WINDOWED:
                k_ok = k_ok & (kk >= base - window)
            j = kk - base
            if HAS_SLOTS:  # key of position base + e: the slot of the token's ancestor at depth e (-1: none)
                e_ok = (j >= 0) & (j < A) & k_ok
                bs = tl.load(bslot_ptr + tok.to(tl.int64) * A + j, mask=e_ok, other=-1)
                key_vis = ((kk < base) & k_ok) | (bs >= 0)
                ks = tl.where(kk < base, kk, tl.maximum(bs, 0).to(tl.int32))
                ld_ok = key_vis
            else:
                ks = kk
                ld_ok = k_ok
            kt = tl.load(k_ptr + kv_base + ks.to(tl.int64)[None, :] * D + dd[:, None], mask=ld_ok[None, :], other=0.0)
            if HAS_SLOTS:
                vis = row_ok[:, None] & key_vis[None, :]
            else:
                in_blk = (j >= 0) & (j < T) & k_ok
                a = tl.load(anc_ptr + t.to(tl.int64)[:, None] * T + j[None, :],
                            mask=row_ok[:, None] & in_blk[None, :], other=0)
                # The reduction (a no-op) hides this 8-bit load from Triton's operand-width heuristic: seen
                # through the mask, it made the p @ V dot take kWidth=4 operands (a different K order inside
                # the MMA) here but kWidth=2 in the paged kernel, and the two paths' rows parted by an ulp.
                a = tl.max(a[:, :, None], axis=2)
                vis = row_ok[:, None] & (((kk < base) & k_ok)[None, :] | (a != 0))
            v = tl.load(v_ptr + kv_base + ks.to(tl.int64)[:, None] * D + dd[None, :], mask=ld_ok[:, None], other=0.0)
            m, l, acc = online_softmax_block(q, kt, v, vis, ones, m, l, acc, qk_scale, DOT_PREC)
        w = (part * (T * H) + t * H + h).to(tl.int64)
        tl.store(ws_m_ptr + w, m, mask=row_ok)
        tl.store(ws_l_ptr + w, l, mask=row_ok)
        tl.store(ws_o_ptr + w[:, None] * D + dd[None, :], acc, mask=row_ok[:, None])


# Splits one combine program reads at once: within a group the weighted partials are summed lane-wise in
# ascending group order and then by one fixed tree over the lanes. Part of the numerics (never tuned): one
# group holds a 4096-key context at 64-key splits, so a row's combine costs a few loads, not two per split.
SPLIT_GROUP = 64


@triton.jit
def combine_splits(ws_m_ptr, ws_l_ptr, ws_o_ptr, row, stride, n_split, D: tl.constexpr, GROUP: tl.constexpr):
    """(acc [D], l) of one row from its split partials (split sp's at ws_*[sp * stride + row]); shared by the
    single-request and paged combines so both reduce with the same statements. A split with no visible key
    (m = -inf) or past n_split adds an exact zero."""
    sp = tl.arange(0, GROUP)
    dd = tl.arange(0, D)
    if n_split <= GROUP:  # one group: every partial in one round of loads (the loops below take two, one L2 trip
        # after the other), the same arithmetic: the group's max is its loads', its sums start from zero
        w = (sp * stride + row).to(tl.int64)
        ms = tl.load(ws_m_ptr + w, mask=sp < n_split, other=float("-inf"))
        ls = tl.load(ws_l_ptr + w, mask=sp < n_split, other=0.0)
        os = tl.load(ws_o_ptr + w[:, None] * D + dd[None, :], mask=(sp < n_split)[:, None], other=0.0)
        top = tl.max(tl.maximum(tl.full([GROUP], float("-inf"), tl.float32), ms), axis=0)
        top = tl.where(top > float("-inf"), top, 0.0)
        use = ms > float("-inf")
        scale = tl.where(use, tl.exp2(ms - top), 0.0)
        lv = tl.zeros([GROUP], dtype=tl.float32) + scale * tl.where(use, ls, 0.0)
        accv = tl.zeros([GROUP, D], dtype=tl.float32) + scale[:, None] * tl.where(use[:, None], os, 0.0)
        acc, l = tl.sum(accv, axis=0), tl.sum(lv, axis=0)
    else:
        mx = tl.full([GROUP], float("-inf"), tl.float32)
        for g0 in range(0, n_split, GROUP):
            w = ((g0 + sp) * stride + row).to(tl.int64)
            mx = tl.maximum(mx, tl.load(ws_m_ptr + w, mask=g0 + sp < n_split, other=float("-inf")))
        top = tl.max(mx, axis=0)
        top = tl.where(top > float("-inf"), top, 0.0)
        lv = tl.zeros([GROUP], dtype=tl.float32)
        accv = tl.zeros([GROUP, D], dtype=tl.float32)
        for g0 in range(0, n_split, GROUP):
            w = ((g0 + sp) * stride + row).to(tl.int64)
            ms = tl.load(ws_m_ptr + w, mask=g0 + sp < n_split, other=float("-inf"))
            use = ms > float("-inf")
            scale = tl.where(use, tl.exp2(ms - top), 0.0)
            lv += scale * tl.load(ws_l_ptr + w, mask=use, other=0.0)
            accv += scale[:, None] * tl.load(ws_o_ptr + w[:, None] * D + dd[None, :], mask=use[:, None], other=0.0)
        acc, l = tl.sum(accv, axis=0), tl.sum(lv, axis=0)
    return acc, l


@triton.jit(do_not_specialize=["T", "base_val", "window"])
def _attn_combine_kernel(ws_m_ptr, ws_l_ptr, ws_o_ptr, o_ptr, base_ptr, T, base_val, S, window,
                         H: tl.constexpr, D: tl.constexpr, BASE_IS_PTR: tl.constexpr, SPLIT: tl.constexpr,
                         GROUP: tl.constexpr, WINDOWED: tl.constexpr = False, PDL: tl.constexpr = 0):
    wait_for_predecessor(PDL)
    row = tl.program_id(0)  # row = t * H + h, one per program
    base = _load_base(base_ptr, base_val, BASE_IS_PTR)
    n_split = tl.cdiv(tl.minimum(base + T, S), SPLIT)
    if WINDOWED:  # the workspace holds the window's splits only, from its first one
        n_split -= tl.maximum(base - window, 0) // SPLIT
    acc, l = combine_splits(ws_m_ptr, ws_l_ptr, ws_o_ptr, row, T * H, n_split, D, GROUP)
    release_successor(PDL)
    out = acc / l  # a row that sees no key gives NaN
    dd = tl.arange(0, D)
    tl.store(o_ptr + row.to(tl.int64) * D + dd, out.to(o_ptr.dtype.element_ty))


def attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: int | torch.Tensor,
                  anc: torch.Tensor, block_slots: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Plain torch: boolean mask over slots 0..base+T-1, fp32 scores and softmax; returns [T, heads * D].

    With block_slots [T, A]: token i's key at position base + e is slot block_slots[i, e] (visible iff >= 0).
    window > 0: only the context's last `window` slots (base - window .. base - 1) are visible."""
    T, H, D = q.shape
    KVH = k_cache.shape[0]
    base = int(base)
    L = base + T
    mask = torch.zeros(T, L, dtype=torch.bool, device=q.device)
    mask[:, max(0, base - window) if window else 0:base] = True
    if block_slots is None:
        mask[:, base:] = anc.bool()
        k = k_cache[:, :L].float().repeat_interleave(H // KVH, dim=0)  # [H, L, D]
        v = v_cache[:, :L].float().repeat_interleave(H // KVH, dim=0)
        scores = torch.einsum("thd,hld->htl", q.float(), k) / math.sqrt(D)
    else:
        A = block_slots.shape[1]
        bs = torch.full((T, T), -1, dtype=torch.long, device=q.device)
        bs[:, :min(A, T)] = block_slots[:, :T]
        mask[:, base:] = bs >= 0
        slot_of = torch.cat([torch.arange(base, device=q.device).expand(T, base), bs.clamp(min=0)], dim=1)  # [T, L]
        k = k_cache[:, slot_of].float().repeat_interleave(H // KVH, dim=0)  # [H, T, L, D]
        v = v_cache[:, slot_of].float().repeat_interleave(H // KVH, dim=0)
        scores = torch.einsum("thd,htld->htl", q.float(), k) / math.sqrt(D)
        probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        return torch.einsum("htl,htld->thd", probs, v).reshape(T, H * D).to(q.dtype)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("htl,hld->thd", probs, v)
    return out.reshape(T, H * D).to(q.dtype)


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """q [T, heads, D] and caches [kv_heads, S, D] of one dtype and device -> (T, heads, D, kv_heads, S)."""
    check_tensor("q", q, (None, None, None), ACT_DTYPES)
    dev, dt = q.device, q.dtype
    T, H, D = q.shape
    if T < 1:
        raise ValueError("q must hold at least one token")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim={D} must be a power of two >= 16")
    check_tensor("k_cache", k_cache, (None, None, D), dt, dev)
    KVH, S = k_cache.shape[0], k_cache.shape[1]
    check_tensor("v_cache", v_cache, (KVH, S, D), dt, dev)
    if KVH < 1 or H % KVH:
        raise ValueError(f"heads={H} must be a multiple of kv_heads={KVH}")
    return T, H, D, KVH, S


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: int | torch.Tensor,
              anc: torch.Tensor, *, block_slots: torch.Tensor | None = None, out: torch.Tensor | None = None,
              block_n: int = 64, split_keys: int = 64, num_warps: int = 4, num_stages: int = 2,
              tiles_per_program: int = 1, tile_rows: int = BLOCK_M, window: int = 0, slot_stages: int = 1
              ) -> torch.Tensor:
    """o [T, heads * D] for q [T, heads, D], caches [kv_heads, S, D], anc [T, T] bool, base + T <= S.

    base: int, or a one-element int32/int64 tensor on q's device (read on the device, no host sync).
    block_slots: optional [T, A] int64: token i reads its key at position base + e from slot block_slots[i, e]
    (the slot of its ancestor at depth e; -1: not visible) instead of slot base + e, so a tree node attends to
    the keys AR would, in position order (anc is then not read). Splits that reach base then tile one token per
    program; splits of context keys only tile as without block_slots (the same bits).
    window: > 0 shows only the context's last `window` slots (base - window .. base - 1; the block drafter's
    context window), 0 all of them. Not with block_slots.
    """
    params = AttentionParams(block_n=block_n, split_keys=split_keys, num_warps=num_warps, num_stages=num_stages,
                             tiles_per_program=tiles_per_program, tile_rows=tile_rows, slot_stages=slot_stages)
    T, H, D, KVH, S = check_qkv(q, k_cache, v_cache)
    dev, dt = q.device, q.dtype
    check_tensor("anc", anc, (T, T), torch.bool, dev)
    if isinstance(base, torch.Tensor):
        check_tensor("base", base, (1,), (torch.int32, torch.int64), dev)
        base_is_ptr, base_val, n_split = True, 0, triton.cdiv(S, split_keys)
        if window:  # from the window's first split to base + T - 1's, wherever base is
            n_split = min(n_split, (window + T - 1) // split_keys + 2)
    else:
        base_val = check_int("base", base, 0, S - T)
        base_is_ptr, n_split = False, triton.cdiv(base_val + T, split_keys)
        if window:
            n_split -= max(base_val - window, 0) // split_keys
    if block_slots is not None:
        check_tensor("block_slots", block_slots, (T, None), torch.int64, dev)
    check_int("window", window, 0, None)
    if window and block_slots is not None:
        raise ValueError("a context window is for the block drafter's attention: not with block_slots")
    check_launchable(_attn_split_kernel, dev)
    out = check_out("out", out, (T, H * D), dt, dev)
    G = H // KVH
    ws_m = torch.empty(n_split * T * H, dtype=torch.float32, device=dev)
    ws_l = torch.empty_like(ws_m)
    ws_o = torch.empty(n_split * T * H * D, dtype=torch.float32, device=dev)
    base_ptr = base if base_is_ptr else ws_m
    qk_scale = LOG2E / math.sqrt(D)
    has_slots = block_slots is not None
    n_ctx = triton.cdiv(T * G, tile_rows)  # (token, head) row tiles
    n_tok = T * triton.cdiv(G, tile_rows)  # per-token tiles (with block_slots, the splits reaching base)
    tiles = min(params.tiles_per_program, max(n_ctx, n_tok) if has_slots else n_ctx)
    p_ctx, p_blk = triton.cdiv(n_ctx, tiles), triton.cdiv(n_tok, tiles)
    n_blk = p_blk * ((T - 1) // split_keys + 2)  # block_slots: the splits a T-token block can reach from any base
    grid = (n_blk + p_ctx * n_split, KVH, 1) if has_slots else (p_ctx, KVH, n_split)
    _attn_split_kernel[grid](
        q, k_cache, v_cache, anc.view(torch.uint8), base_ptr, ws_m, ws_l, ws_o, block_slots if has_slots else ws_m,
        T, base_val, S, block_slots.shape[1] if has_slots else 0, p_ctx, p_blk, n_blk, qk_scale, window,
        H=H, G=G, D=D, BASE_IS_PTR=base_is_ptr, DOT_PREC=dot_precision(dt), BLOCK_M=tile_rows,
        BLOCK_N=params.block_n, SPLIT=params.split_keys, HAS_SLOTS=has_slots, TILES=tiles, WINDOWED=window > 0,
        **NO_FP_FUSION,
        num_warps=num_warps, num_stages=slot_stages if has_slots else num_stages, **pdl_launch(dev))
    _attn_combine_kernel[(T * H,)](
        ws_m, ws_l, ws_o, out, base_ptr, T, base_val, S, window, H=H, D=D, BASE_IS_PTR=base_is_ptr,
        SPLIT=params.split_keys, GROUP=SPLIT_GROUP, WINDOWED=window > 0, num_warps=4, **NO_FP_FUSION,
        **pdl_launch(dev))
    return out
