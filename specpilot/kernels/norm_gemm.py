"""Fused (residual add +) RMSNorm + projection: y = rmsnorm(x [+ residual]) @ W.T, batch-invariant.

Used for the QKV projection (input_layernorm), gate_up (post_attention_layernorm) and lm_head (final norm).
Rounding follows transformers' LlamaRMSNorm and residual stream in the activation dtype:
    h = round(x + residual)                        (the new residual stream, returned when residual is given)
    n = round(weight * round(h_fp32 * rsqrt(mean(h_fp32^2) + eps)))
    y = round(n @ W.T + bias)                      (out_dtype=torch.float32 stores the accumulator unrounded)

Invariance: tokens are tiled by the fixed BLOCK_M; each row's sum of squares is accumulated elementwise over
the fixed BLOCK_K chunks in ascending order and then reduced over the chunk by one fp32 `tl.dot` with ones
(sequential FMAs, the same order whatever the thread layout), so the statistic does not depend on T,
num_warps or BLOCK_N; the projection is the `linear` kernel's fixed tl.dot chain. Each column-tile program
recomputes its rows' statistic (x is small and stays in L2); the program of column tile 0 stores h. The statistic
and normalisation live in rmsnorm.py, which can also run them as a launch of their own (prenorm): the same bits.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (ACT_DTYPES, BLOCK_M, MAX_REGISTERS, MMA_TILE_ROWS, ROW_TILES, LaunchParams, check_launchable,
                      check_out, check_int, check_tensor, dot_precision, register_cap)
from .act import silu_mul
from .gemm import (BLOCK_K, SPLIT_KS, check_split, default_block_n, default_num_stages, fit_block_n, linear_ref,
                   split_k_combine, split_launches, split_size, tile_mac)
from .pdl import check_launch_mode, pdl_launch, prefetch_rows, release_successor, wait_for_predecessor
from .rmsnorm import (check_row_sumsq, check_scaled_x, load_h, normalize, rms_norm_ref, rms_norm_rows, row_rstd,
                      rstd_from_sumsq, stat_segments)
from .rope_kv import rotate
from .topk import TopkPartials, rank_rows
from .w12_tile import OCT_BLOCK, W12Weight, check_w12_launch, oct_block, oct_cell, oct_cols, weight_operand

STAT_UNROLLS = (1, 2, 4, 8)  # K chunks of the norm statistic a program loads before squaring any
# Loads a norm launch issues ahead of their use: 0 none; 1 the next K chunk's x (and norm weight) one iteration ahead;
# 2 that, and the rotary epilogue's positions, slots and cos/sin rows before the K loop instead of after it.
ACT_PREFETCHES = (0, 1, 2)
# Default warps of a norm + projection launch by its K. H200, captured decode step, every norm launch at 4 warps
# against 8 (notes/h200.md, session 13): SmolLM2-135M (K=576) 5-6% faster, Llama-3-8B (K=4096) 0.6% slower at
# T=1 and 5% at T=16.
NORM_WARPS_SMALL_K = 2048


def norm_warps(k: int, num_warps: int | None, w12_pair: bool = False) -> int:
    """num_warps, or when None the default for a launch whose rows have k features (a W12 GLU: 4, H200 session 29,
    rmsnorm_glu 28672x4096 T=1: 98 us against 120 at 8 warps)."""
    if num_warps is not None:
        return num_warps
    return 4 if k <= NORM_WARPS_SMALL_K or w12_pair else 8

# What a norm + projection kernel does with its tile (constexpr: each kind compiles to its own kernel).
EPI_STORE = tl.constexpr(0)  # store y (and/or the argmax partials)
EPI_GLU = tl.constexpr(1)  # gate_up: store silu(gate) * up, the MLP activation (no separate swiglu launch)
EPI_ROPE = tl.constexpr(2)  # qkv: rotate q and k, write k and v to the KV cache (no separate rope_kv launch)


@dataclasses.dataclass(frozen=True)
class RMSNormLinearParams(LaunchParams):
    """None picks a default: block_n from N and T (wider tiles than `linear`, to amortise the norm each program
    recomputes), num_stages from shared memory. Defaults from a sweep on an H200 at Llama-3-8B shapes."""

    block_n: int | None = None
    num_warps: int | None = None  # None: norm_warps(K)
    num_stages: int | None = None
    block_k: int = BLOCK_K  # K chunk of the norm statistic and the accumulation chain: reduction order
    row_tile: int = BLOCK_M  # tokens per program (ROW_TILES, see gemm.py): reduction order
    tile_rows: int = BLOCK_M  # rows of a tensor-core tile (MMA_TILE_ROWS, see gemm.LinearParams): T-neutral
    split_k: int = 1  # K runs per output tile (gemm.split_k_combine): reduction order
    stat_unroll: int = 8  # K chunks of the norm statistic loaded at once (latency, not order: T-neutral)
    act_prefetch: int = 2  # ACT_PREFETCHES: loads issued early (latency, not order: T-neutral)
    # The statistic and normalisation in a launch of their own (rmsnorm.rms_norm_rows), the projection reading the
    # normalised rows: one launch more, no statistic in each program's path (the same statements: T-neutral).
    prenorm: bool = False
    grid_dependency: int | None = None  # this launch's PDL mode (gemm.LinearParams.grid_dependency; not searched)
    # The statistic from the sums of squares the launch that wrote x stored (rmsnorm.py, producer statistics): no
    # pass over x before the first W chunk. Another summation order (reduction order), and it takes the producer's
    # cooperation (the fused forward has o_proj / down store them), so it is judged on the step, not searched.
    producer_stat: bool = False
    # With producer_stat: the producer also stores its rows times this launch's norm weight (gemm.linear's
    # scaled_out), which the K loop reads as a plain projection does (through the pipeline: normalising x in
    # registers cost ~5 us of an 8B QKV launch), and rstd scales each row's accumulator after it. Other roundings
    # than LlamaRMSNorm's (one bf16 rounding of h * w, rstd after the dot): a numerics field, judged on the step.
    post_scale: bool = False
    max_registers: int | None = None  # ptxas maxnreg (_common.MAX_REGISTERS): occupancy only, T-neutral
    T_NEUTRAL: ClassVar[tuple[str, ...]] = ("block_n", "num_warps", "num_stages", "stat_unroll", "act_prefetch",
                                            "prenorm", "grid_dependency", "max_registers", "tile_rows")
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"block_n": (16, 32, 64, 128), "num_warps": (2, 4, 8),
                                                "num_stages": (2, 3, 4, 5), "block_k": (64, 128, 256, 512),
                                                "row_tile": ROW_TILES, "split_k": SPLIT_KS,
                                                "stat_unroll": STAT_UNROLLS, "act_prefetch": ACT_PREFETCHES,
                                                "prenorm": (False, True), "max_registers": MAX_REGISTERS,
                                                "tile_rows": MMA_TILE_ROWS}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stat_unroll not in STAT_UNROLLS:
            raise ValueError(f"stat_unroll={self.stat_unroll!r} must be one of {STAT_UNROLLS}")
        if not isinstance(self.act_prefetch, int) or self.act_prefetch not in ACT_PREFETCHES:
            raise ValueError(f"act_prefetch={self.act_prefetch!r} must be one of {ACT_PREFETCHES}")
        for name in ("prenorm", "producer_stat", "post_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        check_launch_mode(self.grid_dependency)
        if self.post_scale and (not self.producer_stat or self.prenorm):
            raise ValueError("post_scale=True needs producer_stat=True and prenorm=False")


@triton.jit
def _w12_norm_block_mac(acc, acc2, x_ptr, r_ptr, nw_ptr, rstd, row_offs, row_ok, words_ptr, codes_ptr, fat_ptr,
                        w_rows, b2, f, col_ok, w_rows2, b22, f2, col_ok2, k0, K, Kp,
                        HAS_RES: tl.constexpr, DOT_PREC: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
                        BLOCK_M: tl.constexpr, TAIL: tl.constexpr):
    """_two_pass's pass 2 over W12 block k0: x (normalised when NORM) per 32-wide slice, one dot per slice and row
    set, K ascending; TAIL skips the padding slices of the block K ends in (gemm._w12_block_mac)."""
    js = tl.arange(0, 32)
    ws = oct_block(words_ptr, codes_ptr, fat_ptr, w_rows, b2, f, col_ok, k0, Kp)
    if PAIR:
        ws2 = oct_block(words_ptr, codes_ptr, fat_ptr, w_rows2, b22, f2, col_ok2, k0, Kp)
    for e in tl.static_range(8):
        if not TAIL or k0 + 32 * e < K:
            kk = k0 + 32 * e + js
            k_ok = kk < K
            if not NORM:
                a = tl.load(x_ptr + row_offs + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                h = load_h(x_ptr, r_ptr, row_offs + kk[None, :], row_ok[:, None] & k_ok[None, :], HAS_RES)
                a = normalize(h, tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32), rstd)
            acc = tile_mac(a, ws[e], acc, DOT_PREC, BLOCK_M)
            if PAIR:
                acc2 = tile_mac(a, ws2[e], acc2, DOT_PREC, BLOCK_M)
    return acc, acc2


@triton.jit
def _two_pass(x_ptr, r_ptr, nw_ptr, h_ptr, ss_ptr, w_cols, w_cols2, words_ptr, codes_ptr, base_ptr, fcell_ptr, fat_ptr,
              Kp, cols, cols2, rows, row_offs, row_ok, col_ok, col_ok2, ks, h_owner, k_lo, k_hi, K, eps,
              HAS_RES: tl.constexpr,
              DOT_PREC: tl.constexpr, PAIR: tl.constexpr, W12: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAT_UNROLL: tl.constexpr,
              ACT_PREFETCH: tl.constexpr, NORM: tl.constexpr, STAT_SEGS: tl.constexpr):
    """-> (acc over W rows `cols`, acc over W rows `cols2` when PAIR: a second W row set fed by the same normalised
    tile), over K range [k_lo, k_hi) (the statistic always over all of K; h_owner stores h). bf16 W: read through
    w_cols / w_cols2; W12 W (w12_tile.py): decoded from its arrays. NORM=False: x holds the normalised rows already
    (rmsnorm.rms_norm_rows), or (post_scale, with STAT_SEGS > 0) the rows times the norm weight: a plain projection
    of them. STAT_SEGS > 0 with NORM: the statistic from the producer's segment sums at ss_ptr
    (rmsnorm.rstd_from_sumsq), not from a pass over x."""
    # pass 1: per-row statistic (rmsnorm.row_rstd)
    rstd = 0.0  # unused without NORM
    if NORM:
        if STAT_SEGS > 0:
            rstd = rstd_from_sumsq(ss_ptr, rows, row_ok, K, eps, BLOCK_M, STAT_SEGS)
        else:
            rstd = row_rstd(x_ptr, r_ptr, h_ptr, row_offs, row_ok, ks, h_owner, K, eps, HAS_RES, BLOCK_M, BLOCK_K,
                            STAT_UNROLL)

    # pass 2: normalise each chunk with the dtype roundings of LlamaRMSNorm and feed the projection
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W12:  # W12 weights (w12_tile.py): 256-element blocks, each eight 32-wide slices of x and dots, K ascending
        w_rows, b2, cells = oct_cols(base_ptr, cols, col_ok, Kp)
        w_rows2, b22, cells2 = oct_cols(base_ptr, cols2, col_ok2, Kp)  # unused (and dropped) without PAIR
        k_full = k_lo + (k_hi - k_lo) // OCT_BLOCK * OCT_BLOCK
        # each block's cells loaded one iteration ahead (w12_tile.oct_cell: no indirect load for the pipeliner)
        f, f2 = oct_cell(fcell_ptr, cells, col_ok, k_lo, Kp), oct_cell(fcell_ptr, cells2, col_ok2, k_lo, Kp)
        for k0 in range(k_lo, k_full, OCT_BLOCK):  # whole blocks: a body without branches (gemm._w12_block_mac)
            k_next = k0 + OCT_BLOCK
            f_next, f2_next = (oct_cell(fcell_ptr, cells, col_ok, k_next, Kp),
                               oct_cell(fcell_ptr, cells2, col_ok2, k_next, Kp))
            acc, acc2 = _w12_norm_block_mac(acc, acc2, x_ptr, r_ptr, nw_ptr, rstd, row_offs, row_ok, words_ptr,
                                            codes_ptr, fat_ptr, w_rows, b2, f, col_ok, w_rows2, b22, f2, col_ok2, k0,
                                            K, Kp, HAS_RES, DOT_PREC, PAIR, NORM, BLOCK_M, False)
            f, f2 = f_next, f2_next
        if k_full < k_hi:  # K's tail block, its padding slices skipped
            acc, acc2 = _w12_norm_block_mac(acc, acc2, x_ptr, r_ptr, nw_ptr, rstd, row_offs, row_ok, words_ptr,
                                            codes_ptr, fat_ptr, w_rows, b2, f, col_ok, w_rows2, b22, f2, col_ok2,
                                            k_full, K, Kp, HAS_RES, DOT_PREC, PAIR, NORM, BLOCK_M, True)
    else:
        # ACT_PREFETCH >= 1: the next chunk's x (and norm weight) is loaded one iteration ahead. Its L2 latency
        # otherwise sits on every iteration's critical path (x feeds arithmetic before the dot, so Triton does not
        # pipeline it): one program of a Llama-3-8B-sized launch took 24 us against the plain GEMM's 15.
        if ACT_PREFETCH >= 1 and NORM:
            kk = k_lo + ks
            h_next = load_h(x_ptr, r_ptr, row_offs + kk[None, :], row_ok[:, None] & (kk < K)[None, :], HAS_RES)
            nw_next = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            if not NORM:  # feeds the dot unchanged: the pipeliner loads it ahead, as in `linear`
                a = tl.load(x_ptr + row_offs + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                if ACT_PREFETCH >= 1:
                    h, nw = h_next, nw_next
                    kn = kk + BLOCK_K
                    h_next = load_h(x_ptr, r_ptr, row_offs + kn[None, :], row_ok[:, None] & (kn < K)[None, :], HAS_RES)
                    nw_next = tl.load(nw_ptr + kn, mask=kn < K, other=0.0).to(tl.float32)
                else:
                    h = load_h(x_ptr, r_ptr, row_offs + kk[None, :], row_ok[:, None] & k_ok[None, :], HAS_RES)
                    nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                a = normalize(h, nw, rstd)
            wm = k_ok[:, None] & col_ok[None, :]
            acc = tile_mac(a, tl.load(w_cols + kk[:, None], mask=wm, other=0.0), acc, DOT_PREC, BLOCK_M)
            if PAIR:
                wm2 = k_ok[:, None] & col_ok2[None, :]
                acc2 = tile_mac(a, tl.load(w_cols2 + kk[:, None], mask=wm2, other=0.0), acc2, DOT_PREC, BLOCK_M)
    return acc, acc2


@triton.jit
def _rope_inputs(rows, cols, row_ok, col_ok, pos_ptr, slot_ptr, cos_ptr, sin_ptr, S, max_pos, HALF: tl.constexpr):
    """The rotary epilogue's loads for a QKV tile: (rows with a valid position and slot, slots, cos, sin)."""
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    ok = row_ok & (pos >= 0) & (pos < max_pos) & (slot >= 0) & (slot < S)
    tab = pos.to(tl.int64)[:, None] * HALF + ((cols % (2 * HALF)) % HALF)[None, :]
    tm = ok[:, None] & col_ok[None, :]
    return ok, slot, tl.load(cos_ptr + tab, mask=tm, other=0.0), tl.load(sin_ptr + tab, mask=tm, other=0.0)


@triton.jit
def _rope_tile_cols(pid_n, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """A QKV tile's columns: BLOCK_N / 2 consecutive columns of one head's first half, then their rotate_half
    partners (the same offsets in the second half), so the rotary epilogue finds every partner in its own tile
    and W is read once (BLOCK_N <= head_dim = 2 * HALF). The tiles cover all columns, each once; a column's dot
    chain does not depend on the tile that owns it: the same bits as contiguous tiles."""
    PH: tl.constexpr = BLOCK_N // 2
    PER_HEAD: tl.constexpr = HALF // PH
    i = tl.arange(0, BLOCK_N)
    return (pid_n // PER_HEAD) * (2 * HALF) + (i // PH) * HALF + (pid_n % PER_HEAD) * PH + i % PH


@triton.jit
def _swap_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's columns with its two halves exchanged: each _rope_tile_cols column's partner value."""
    a = tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1))
    first, second = tl.split(a)
    return tl.reshape(tl.permute(tl.join(second, first), (0, 2, 1)), [BLOCK_M, BLOCK_N])


@triton.jit
def _rope_epilogue(acc, acc2, rows, cols, row_ok, col_ok, q_ptr, kc_ptr, vc_ptr, S, ok, slot, c, s,
                   H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr):
    """rope_kv_write's arithmetic on a QKV tile: q rotated to q [T, H*D]; k rotated and v to the caches at slots.
    acc2: each column's rotate_half partner's accumulator; ok, slot, c, s: _rope_inputs; row_ok: the rows this
    program stores."""
    D: tl.constexpr = 2 * HALF
    dtype = q_ptr.dtype.element_ty
    y = acc.to(dtype)
    x = y.to(tl.float32)  # the rotation reads the rounded projection, as rope_kv_write reads qkv
    xp = acc2.to(dtype).to(tl.float32)
    ok = ok & row_ok
    d = cols % D
    first = d < HALF
    is_q = col_ok & (cols < H * D)
    is_k = col_ok & (cols >= H * D) & (cols < (H + KVH) * D)
    is_v = col_ok & (cols >= (H + KVH) * D)
    rot = rotate(x, c, tl.where(first[None, :], -(xp * s), xp * s)).to(dtype)  # [x1 c - x2 s, x2 c + x1 s]
    nan = tl.full([1, 1], float("nan"), tl.float32).to(dtype)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * (H * D) + cols[None, :], tl.where(ok[:, None], rot, nan),
             mask=row_ok[:, None] & is_q[None, :])
    kvh = tl.where(is_v, cols - (H + KVH) * D, cols - H * D) // D
    cache = (kvh[None, :] * S + slot[:, None]).to(tl.int64) * D + d[None, :]
    tl.store(kc_ptr + cache, rot, mask=ok[:, None] & is_k[None, :])
    tl.store(vc_ptr + cache, y, mask=ok[:, None] & is_v[None, :])


@triton.jit(do_not_specialize=["T"])
def _rmsnorm_linear_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, words_ptr, codes_ptr, base_ptr, fcell_ptr, fat_ptr, Kp,
                           b_ptr, y_ptr, h_ptr, pmax_ptr, pidx_ptr, tk_ptr, ts_ptr, ws_ptr, cnt_ptr, ss_ptr,
                           pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, S, max_pos, T, N, K,
                           K_SPLIT, eps,
                           HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, W12: tl.constexpr,
                           STORE_Y: tl.constexpr, ARGMAX: tl.constexpr, EPI: tl.constexpr,
                           H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr = 1, STAT_UNROLL: tl.constexpr = 8,
                           ACT_PREFETCH: tl.constexpr = 1, PDL: tl.constexpr = 0,
                           PF_LINES: tl.constexpr = 16, NORM: tl.constexpr = True, STAT_SEGS: tl.constexpr = 0,
                           TOPK: tl.constexpr = 0):
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    tile = pid % tiles
    pid_k = pid // tiles  # split-K run (gemm.split_k_combine; 0 without split-K)
    pid_m = tile % num_m
    pid_n = tile // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if EPI == EPI_ROPE:
        cols = _rope_tile_cols(pid_n, BLOCK_N, HALF)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    row_offs = rows.to(tl.int64)[:, None] * K
    dtype = x_ptr.dtype.element_ty

    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    # output column j = silu(gate_j) * up_j: gate is W row j, up is W row N + j (no second row set otherwise)
    cols2 = cols + N if EPI == EPI_GLU else cols
    col_ok2 = col_ok
    if not W12:  # and gate_up's up rows
        prefetch_rows(w_ptr + tl.minimum(cols, N - 1).to(tl.int64) * K, K, PDL, PF_LINES)
        if EPI == EPI_GLU:
            prefetch_rows(w_ptr + tl.minimum(cols2, 2 * N - 1).to(tl.int64) * K, K, PDL, PF_LINES)
    wait_for_predecessor(PDL)  # x and the residual come from the previous kernel
    if EPI == EPI_ROPE and ACT_PREFETCH >= 2:  # positions may come from the previous kernel too (device loop)
        rope_ok, rope_slot, rope_c, rope_s = _rope_inputs(rows, cols, row_ok, col_ok, pos_ptr, slot_ptr, cos_ptr,
                                                          sin_ptr, S, max_pos, HALF)
    if not NORM and STAT_SEGS > 0:  # post_scale: x holds h * norm_w; rstd scales the accumulators below
        post_rstd = rstd_from_sumsq(ss_ptr, rows, row_ok, K, eps, BLOCK_M, STAT_SEGS)
    k_lo = pid_k * K_SPLIT
    acc, acc2 = _two_pass(x_ptr, r_ptr, nw_ptr, h_ptr, ss_ptr, w_cols, w_ptr + cols2.to(tl.int64)[None, :] * K,
                          words_ptr, codes_ptr, base_ptr, fcell_ptr, fat_ptr, Kp, cols, cols2, rows, row_offs,
                          row_ok, col_ok, col_ok2, ks, (pid_n == 0) & (pid_k == 0), k_lo,
                          tl.minimum(K, k_lo + K_SPLIT), K, eps, HAS_RES, DOT_PREC, EPI == EPI_GLU, W12, BLOCK_M,
                          BLOCK_N, BLOCK_K, STAT_UNROLL, ACT_PREFETCH, NORM, STAT_SEGS)
    release_successor(PDL)
    acc, acc2, last = split_k_combine(acc, acc2, ws_ptr, cnt_ptr, tile, pid_k, SPLIT_K, EPI == EPI_GLU, BLOCK_M,
                                      BLOCK_N)
    row_ok = row_ok & last  # only the tile's last split-K program stores (all of them without split-K)
    if not NORM and STAT_SEGS > 0:
        acc = acc * post_rstd[:, None]
        acc2 = acc2 * post_rstd[:, None]
    if EPI == EPI_GLU:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], silu_mul(acc.to(dtype), acc2.to(dtype)),
                 mask=row_ok[:, None] & col_ok[None, :])
    elif EPI == EPI_ROPE:
        if ACT_PREFETCH < 2:
            rope_ok, rope_slot, rope_c, rope_s = _rope_inputs(rows, cols, row_ok, col_ok, pos_ptr, slot_ptr, cos_ptr,
                                                              sin_ptr, S, max_pos, HALF)
        _rope_epilogue(acc, _swap_halves(acc, BLOCK_M, BLOCK_N), rows, cols, row_ok, col_ok, y_ptr, kc_ptr, vc_ptr,
                       S, rope_ok, rope_slot, rope_c, rope_s, H, KVH, HALF)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if STORE_Y:
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if TOPK > 0:  # per column tile: the rows' top TOPK (value, column) keys, max and sum of exp (kernels.topk merges)
        m, ssum, top = rank_rows(tl.where(col_ok[None, :], acc, float("-inf")), cols[None, :], col_ok[None, :], N, TOPK)
        part = rows * tl.cdiv(N, BLOCK_N) + pid_n
        tl.store(pmax_ptr + part, m, mask=row_ok)
        tl.store(ts_ptr + part, ssum, mask=row_ok)
        tl.store(tk_ptr + part.to(tl.int64)[:, None] * TOPK + tl.arange(0, TOPK)[None, :], top, mask=row_ok[:, None])
    if ARGMAX:  # per column tile: the rows' max of the stored values and its first column (argmax_combine ends it)
        vals = tl.where(col_ok[None, :], acc.to(y_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
        num_n = tl.cdiv(N, BLOCK_N)
        tl.store(pmax_ptr + rows * num_n + pid_n, tl.max(vals, axis=1), mask=row_ok)
        tl.store(pidx_ptr + rows * num_n + pid_n, pid_n * BLOCK_N + tl.argmax(vals, axis=1, tie_break_left=True),
                 mask=row_ok)


@triton.jit
def _argmax_combine_kernel(pmax_ptr, pidx_ptr, out_ptr, NT, BLOCK_T: tl.constexpr, PDL: tl.constexpr = 0):
    # One row per program: the max over tiles is exact in any order and the winner is the lowest column holding
    # it, which is torch.argmax's first occurrence.
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)
    ok = t < NT
    m = tl.load(pmax_ptr + row * NT + t, mask=ok, other=float("-inf"))
    i = tl.load(pidx_ptr + row * NT + t, mask=ok, other=2147483647)
    best = tl.max(m, axis=0)
    release_successor(PDL)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (m == best), i, 2147483647), axis=0).to(tl.int64))


def rmsnorm_linear_ref(x: torch.Tensor, norm_w: torch.Tensor, W: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None):
    """Plain torch: h = x (+ residual); y = linear(rms_norm(h)); returns y, or (y, h) when residual is given."""
    h = x if residual is None else x + residual
    y = linear_ref(rms_norm_ref(h, norm_w, eps), W, bias=bias, out_dtype=out_dtype)
    return y if residual is None else (y, h)


def check_norm_inputs(x, norm_w, W, eps, residual, residual_out, block_n, num_warps, num_stages, block_k,
                      w_rows_per_out: int = 1, row_tile: int = BLOCK_M, split_k: int = 1, stat_unroll: int = 8,
                      act_prefetch: int = 2, prenorm: bool = False, grid_dependency: int | None = None,
                      producer_stat: bool = False, row_sumsq: torch.Tensor | None = None,
                      post_scale: bool = False, scaled_x: torch.Tensor | None = None,
                      max_registers: int | None = None, tile_rows: int = BLOCK_M) -> tuple:
    """Checks shared by every norm + projection wrapper -> (T, K, N outputs, residual_out, W's kernel arguments,
    W12 flag, token rows a program: the kernel's BLOCK_M): see w12_tile.weight_operand."""
    rows_pp = RMSNormLinearParams(block_n=block_n, num_warps=num_warps, num_stages=num_stages, block_k=block_k,
                                  row_tile=row_tile, tile_rows=tile_rows, split_k=split_k, stat_unroll=stat_unroll,
                                  act_prefetch=act_prefetch, prenorm=prenorm, grid_dependency=grid_dependency,
                                  producer_stat=producer_stat, post_scale=post_scale,
                                  max_registers=max_registers).program_rows()
    check_tensor("x", x, (None, None), ACT_DTYPES)
    dev, dt = x.device, x.dtype
    T, K = x.shape
    if T < 1 or K < 1:
        raise ValueError(f"x must be [T >= 1, K >= 1], got {list(x.shape)}")
    check_tensor("norm_w", norm_w, (K,), dt, dev)
    check_row_sumsq(row_sumsq, producer_stat, x, residual)
    check_scaled_x(scaled_x, post_scale, x)
    w_args, w12, rows = weight_operand(W, K, dt, dev, w_rows_per_out)
    check_split(split_k)
    check_w12_launch(w12, rows_pp, split_size(K, block_k, split_k), K)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    if residual is not None:
        check_tensor("residual", residual, (T, K), dt, dev)
        residual_out = check_out("residual_out", residual_out, (T, K), dt, dev)
    elif residual_out is not None:
        raise ValueError("residual_out is only written when residual is given")
    check_launchable(_rmsnorm_linear_kernel, dev)
    return T, K, rows // w_rows_per_out, residual_out, w_args, w12, rows_pp


class NormOperand(NamedTuple):
    x: torch.Tensor  # the rows the kernel reads
    residual: torch.Tensor | None
    norm: bool  # NORM: the kernel normalises x (+ residual)
    row_sumsq: torch.Tensor  # the producer's segment sums (a placeholder when stat_segs == 0)
    stat_segs: int  # STAT_SEGS: 0, the statistic from x; else from row_sumsq


def norm_operand(x: torch.Tensor, norm_w: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 residual_out: torch.Tensor | None, prenorm: bool, block_k: int, row_tile: int,
                 num_warps: int, row_sumsq: torch.Tensor | None = None,
                 scaled_x: torch.Tensor | None = None) -> NormOperand:
    """x and residual as given (the kernel normalises, its statistic from row_sumsq when given), or with prenorm
    the normalised rows from rmsnorm.rms_norm_rows (h = x + residual written there), or with post_scale (scaled_x
    given) the producer's scaled rows, projected as they are and scaled by rstd from row_sumsq after."""
    if scaled_x is not None:
        return NormOperand(scaled_x, None, False, row_sumsq, stat_segments(x.shape[1]))
    if not prenorm:
        segs = 0 if row_sumsq is None else stat_segments(x.shape[1])
        return NormOperand(x, residual, True, x if row_sumsq is None else row_sumsq, segs)
    a = rms_norm_rows(x, norm_w, eps, residual, residual_out, block_k=block_k, row_tile=row_tile,
                      num_warps=num_warps, row_sumsq=row_sumsq)
    return NormOperand(a, None, False, x, 0)


def norm_launch_shape(x: torch.Tensor, n: int, block_n, num_stages, block_k: int, row_tile: int = BLOCK_M,
                      split_k: int = 1, pair: bool = False,
                      max_block_n: int | None = None, w12: bool = False) -> tuple[int, int, list[tuple]]:
    """(block_n, num_stages, launches) of a norm + projection with n output columns; launches: gemm.split_launches
    (first row, end row, grid, split-K workspace, counters, K per split); pair: two W row sets per column;
    max_block_n: the widest tile the epilogue allows (the default is capped to it, a wider block_n refused);
    w12: W is a W12 weight (its pipeline stages are sized by 256-element blocks)."""
    T = x.shape[0]
    if block_n is None:
        bn = fit_block_n(default_block_n(n, T, target_programs=64, row_tile=row_tile, w12=w12), block_k,
                         x.element_size())
        bn = bn if max_block_n is None else min(bn, max_block_n)
    elif max_block_n is not None and block_n > max_block_n:
        raise ValueError(f"block_n={block_n} exceeds {max_block_n}, the widest tile this epilogue allows")
    else:
        bn = block_n
    # W12: x's slices feed the norm's arithmetic and stay out of the pipeline; a pair's two row sets both stage, so
    # its tile is twice as wide (H200, rmsnorm_glu 28672x4096 T=1, block_n 64: 2 stages 83 us, 3 stages 100: session 31)
    stages = default_num_stages(bn * (2 if pair and w12 else 1), x.element_size(), 0 if w12 else 1, most=4,
                                block_k=block_k, row_tile=row_tile, w12=w12) if num_stages is None else num_stages
    return bn, stages, split_launches(x.device, T, n, x.shape[1], block_k, row_tile, bn, split_k, pair)


def rmsnorm_linear(x: torch.Tensor, norm_w: torch.Tensor, W: torch.Tensor | W12Weight, eps: float,
                   residual: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                   residual_out: torch.Tensor | None = None, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, block_k: int = BLOCK_K, row_tile: int = BLOCK_M,
                   argmax: bool = False, store_y: bool = True, split_k: int = 1, stat_unroll: int = 8,
                   act_prefetch: int = 2, prenorm: bool = False, grid_dependency: int | None = None,
                   producer_stat: bool = False, row_sumsq: torch.Tensor | None = None, post_scale: bool = False,
                   scaled_x: torch.Tensor | None = None, max_registers: int | None = None, topk: int = 0,
                   tile_rows: int = BLOCK_M):
    """rmsnorm(x (+ residual)) @ W.T (+ bias) for x [T, K], norm_w [K], W [N, K], all contiguous, one dtype; or W a
    W12 weight [N, K] (OctLayout, or W12Tensor converted on each call) with bf16 x (decoded in the kernel: the bits of
    W = decode(W)).
    producer_stat: the statistic from row_sumsq [T, K / 16], the segment sums of squares the launch that wrote x
    stored (gemm.linear(..., row_sumsq_out=)); no residual then. post_scale (with producer_stat): W @ scaled_x,
    x * norm_w as that launch stored it too (gemm.linear(..., scale_w=norm_w, scaled_out=)), times each row's rstd.

    Returns y [T, N] (out_dtype, default x.dtype) when residual is None, else (y, x + residual).
    argmax=True (no residual; an LM head): returns (y or None when store_y=False, argmax int64 [T]), the first
    column of each row's maximum of y, found in the epilogue (the logits need not be written and re-read).
    topk=KP (a power of two >= 2, at most the column tile; float32 out, no residual; a drafter's head): returns (y or
    None when store_y=False, TopkPartials), each column tile's top KP of every row and its max and sum of exp, for
    kernels.topk.merge_topk (the logits need not be written and re-read).
    """
    T, K, N, residual_out, w_args, w12, rows_pp = check_norm_inputs(
        x, norm_w, W, eps, residual, residual_out, block_n, num_warps, num_stages, block_k, row_tile=row_tile,
        split_k=split_k, stat_unroll=stat_unroll, act_prefetch=act_prefetch, prenorm=prenorm,
        grid_dependency=grid_dependency, producer_stat=producer_stat, row_sumsq=row_sumsq, post_scale=post_scale,
        scaled_x=scaled_x, max_registers=max_registers, tile_rows=tile_rows)
    num_warps = norm_warps(K, num_warps)
    dev, dt = x.device, x.dtype
    out_dtype = dt if out_dtype is None else out_dtype
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"out_dtype must be one of {ACT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, (N,), dt, dev)
    if ((argmax or topk) and residual is not None) or not (store_y or argmax or topk) or (argmax and topk):
        raise ValueError("argmax / topk need residual=None; store_y=False needs argmax=True or topk; not both")
    out = check_out("out", out, (T, N), out_dtype, dev) if store_y else torch.empty(1, dtype=out_dtype, device=dev)
    bn, stages, launches = norm_launch_shape(x, N, block_n, num_stages, block_k, rows_pp, split_k, w12=w12)
    op = norm_operand(x, norm_w, eps, residual, residual_out, prenorm, block_k, row_tile, num_warps, row_sumsq,
                      scaled_x)
    xk, rk = op.x, op.residual
    has_res = rk is not None
    tiles = triton.cdiv(N, bn)
    if topk:
        check_int("topk", topk, 2, bn)
        if topk & (topk - 1) or out_dtype is not torch.float32:
            raise ValueError(f"topk={topk}: a power of two, with out_dtype float32 (got {out_dtype})")
    pmax = torch.empty((T, tiles) if argmax or topk else (1, 1), dtype=torch.float32, device=dev)
    pidx = torch.empty((T, tiles) if argmax else (1, 1), dtype=torch.int32, device=dev)
    tk = torch.empty((T, tiles, topk) if topk else (1, 1, 1), dtype=torch.int64, device=dev)
    ts = torch.empty((T, tiles) if topk else (1, 1), dtype=torch.float32, device=dev)
    rows = lambda t, r0, r1: t[r0:r1] if t.shape[0] == T else t  # noqa: E731 - per-row tensors, not placeholders
    for r0, r1, grid, ws, counters, per_split in launches:
        _rmsnorm_linear_kernel[grid](xk[r0:r1], rows(rk, r0, r1) if has_res else x, norm_w, *w_args,
                                 x if bias is None else bias, rows(out, r0, r1),
                                 rows(residual_out, r0, r1) if has_res else out, rows(pmax, r0, r1),
                                 rows(pidx, r0, r1), rows(tk, r0, r1), rows(ts, r0, r1), ws, counters,
                                 rows(op.row_sumsq, r0, r1), *_NO_ROPE(x),
                                 r1 - r0, N, K, per_split,
                                 float(eps),
                                 HAS_RES=has_res, HAS_BIAS=bias is not None, DOT_PREC=dot_precision(dt), W12=w12,
                                 STORE_Y=store_y, ARGMAX=argmax, EPI=0, H=1, KVH=1, HALF=1, BLOCK_M=rows_pp,
                                 BLOCK_N=bn, BLOCK_K=block_k, SPLIT_K=split_k, STAT_UNROLL=stat_unroll,
                                 ACT_PREFETCH=act_prefetch, NORM=op.norm, STAT_SEGS=op.stat_segs, TOPK=topk,
                                 num_warps=num_warps, num_stages=stages, **norm_pdl(x, N, K, grid_dependency),
                                 **register_cap(max_registers))
    if topk:
        return (out if store_y else None), TopkPartials(tk, pmax, ts, N)
    if argmax:
        best = torch.empty(T, dtype=torch.int64, device=dev)
        _argmax_combine_kernel[(T,)](pmax, pidx, best, tiles, BLOCK_T=triton.next_power_of_2(tiles), num_warps=4,
                                     **pdl_launch(dev))
        return (out if store_y else None), best
    return out if residual is None else (out, residual_out)


def norm_pdl(x: torch.Tensor, w_rows: int, k: int, mode: int | None = None) -> dict:
    """The PDL launch keywords of a norm + projection launch (kernels/pdl.py) reading W [w_rows, k]; mode: the
    launch's own grid_dependency, if any."""
    return pdl_launch(x.device, w_rows, k, x.element_size(), mode)


def _NO_ROPE(x: torch.Tensor) -> tuple:
    """Placeholder rope arguments (pos, slot, cos, sin, k cache, v cache, S, max_pos) for other epilogues."""
    return x, x, x, x, x, x, 1, 1
