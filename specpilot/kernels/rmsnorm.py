"""The RMSNorm statistic and normalisation every norm + projection kernel runs (norm_gemm.py), and a kernel that
runs them alone: `rms_norm_rows` writes the normalised rows, so a projection can read them instead of recomputing
the statistic in each of its programs (RMSNormLinearParams.prenorm).

Why it is an option: a fused norm + projection program reads and reduces all of x before its first W chunk, and
every program pays that latency. H200, Llama-3-8B shapes, T=1 (notes/h200.md, session 23): the fused QKV launch
(norm + rotary epilogue) took 21.7 us where a plain projection of the same matrix took 15.6 us. The separate launch
cost about what it saved there (the whole step: QKV 1.000x, LM head 1.000x, gate_up 0.957x; SmolLM2 0.98-1.005x),
so it is off by default, a field the kernel tuner may turn where a shape gains.

The bits are those of the fused kernels: the same statements (row_rstd, normalize) with the same BLOCK_K and
BLOCK_M, so the normalised tile a projection multiplies is the same whichever launch made it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, release_successor, wait_for_predecessor


@triton.jit
def load_h(x_ptr, r_ptr, offs, mask, HAS_RES: tl.constexpr):
    """x (+ residual, rounded to x's dtype) at offs."""
    h = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h


@triton.jit
def row_rstd(x_ptr, r_ptr, h_ptr, row_offs, row_ok, ks, h_owner, K, eps, HAS_RES: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAT_UNROLL: tl.constexpr):
    """1 / sqrt(mean(h^2) + eps) per row of h = x (+ residual), stored to h_ptr where h_owner (with HAS_RES).

    The sum of squares in a fixed order: elementwise over the BLOCK_K chunks in ascending order, then one
    sequential fp32 dot with ones (the same order whatever the thread layout). STAT_UNROLL chunks are loaded before
    any is squared: their L2 latencies overlap instead of adding up (one at a time, Llama-3-8B's 32 chunks took
    ~10 us of a 27 us launch). Masked chunks past K add +0.0: the same bits."""
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, STAT_UNROLL * BLOCK_K):
        hs = ()
        for u in tl.static_range(STAT_UNROLL):
            kk = k0 + u * BLOCK_K + ks
            xm = row_ok[:, None] & (kk < K)[None, :]
            h = load_h(x_ptr, r_ptr, row_offs + kk[None, :], xm, HAS_RES)
            if HAS_RES:
                tl.store(h_ptr + row_offs + kk[None, :], h, mask=xm & h_owner)
            hs = hs + (h,)
        for u in tl.static_range(STAT_UNROLL):
            hf = hs[u].to(tl.float32)
            sq += hf * hf
    return rstd_of_lanes(sq, K, eps, BLOCK_M, BLOCK_K)


@triton.jit
def rstd_of_lanes(sq, K, eps, BLOCK_M: tl.constexpr, LANES: tl.constexpr):
    """1 / sqrt(sum / K + eps) per row of sq [BLOCK_M, LANES] fp32, the lanes added in a fixed order."""
    if BLOCK_M == 1:  # one row: tl.sum, its tree fixed by the (T-independent) tile layout
        ss = tl.sum(sq, axis=1)
    else:
        ones = tl.full([LANES, 16], 1.0, tl.float32)
        ss = tl.max(tl.dot(sq, ones, input_precision="ieee"), axis=1)  # 16 identical columns: max picks the value
    return 1.0 / tl.sqrt_rn(ss / K + eps)


# Producer statistics (RMSNormLinearParams.producer_stat): the launch that writes a row (o_proj, down: gemm.linear
# with row_sumsq_out) also stores the sums of squares of its 16-column segments, and the norm launch that reads the
# row adds those K / 16 numbers instead of reading all of it before its first W chunk. 16 is the narrowest column
# tile a projection takes, so every tile holds whole segments. A segment is summed by a fixed pairwise tree of
# elementwise adds, the segments as row_rstd sums squares: neither order depends on the tile width, the warps,
# split-K or T (tests/test_row_sumsq.py).
STAT_SEGMENT = 16


@triton.jit
def pair_tree_sum(v, M: tl.constexpr, S: tl.constexpr, W: tl.constexpr):
    """[M, S, W] -> [M, S]: each W-long row summed by a fixed tree, adjacent pairs first (W a power of two; elementwise
    adds on reshaped registers, so the order is the same whatever the thread layout)."""
    for level in tl.static_range(12):
        if (W >> level) > 1:
            a, b = tl.split(tl.reshape(v, [M, S, W >> (level + 1), 2]))
            v = a + b
    return tl.reshape(v, [M, S])


@triton.jit
def store_row_sumsq(ss_ptr, y, rows, pid_n, row_ok, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores the sums of squares of y's 16-column segments (y: the [BLOCK_M, BLOCK_N] tile of column tile pid_n,
    as stored) to ss_ptr [T, N / 16] fp32."""
    SEGS: tl.constexpr = BLOCK_N // 16
    v = y.to(tl.float32)
    seg = pair_tree_sum(tl.reshape(v * v, [BLOCK_M, SEGS, 16]), BLOCK_M, SEGS, 16)
    segs = pid_n * SEGS + tl.arange(0, SEGS)
    tl.store(ss_ptr + rows.to(tl.int64)[:, None] * (N // 16) + segs[None, :], seg,
             mask=row_ok[:, None] & (segs < N // 16)[None, :])


@triton.jit
def rstd_from_sumsq(ss_ptr, rows, row_ok, K, eps, BLOCK_M: tl.constexpr, SEGS: tl.constexpr):
    """row_rstd's quantity from a producer's segment sums ss_ptr [T, K / 16]: added as row_rstd adds squares, in
    16-wide chunks elementwise in ascending order (all chunks loaded at once), then the 16 lanes by one sequential
    fp32 dot with ones. SEGS: K / 16 rounded up to a multiple of 16; the padding adds +0.0, which changes no sum of
    squares. (A pairwise tree over all segments at once compiled for sm_90 to a layout holding every segment in
    every thread: 22 KB of spills a thread.)"""
    lanes = tl.arange(0, 16)
    parts = ()
    for c in tl.static_range(SEGS // 16):
        seg = c * 16 + lanes
        parts = parts + (tl.load(ss_ptr + rows.to(tl.int64)[:, None] * (K // 16) + seg[None, :],
                                 mask=row_ok[:, None] & (seg < K // 16)[None, :], other=0.0),)
    acc = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    for c in tl.static_range(SEGS // 16):
        acc += parts[c]
    return rstd_of_lanes(acc, K, eps, BLOCK_M, 16)


def row_sumsq_ref(h: torch.Tensor) -> torch.Tensor:
    """[T, K / 16] fp32: what store_row_sumsq stores for rows h [T, K] (K a multiple of 16), in plain torch."""
    v = h.float().square().view(h.shape[0], -1, STAT_SEGMENT)
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0].contiguous()


def scaled_rows_ref(h: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    """h * norm_w rounded to h's dtype: what a producer stores for a norm launch with post_scale (gemm.linear's
    scaled_out), in plain torch."""
    return (h.float() * norm_w.float()).to(h.dtype)


def post_scale_ref(h: torch.Tensor, norm_w: torch.Tensor, W: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 [T, N]: a post-scale norm launch's accumulator, rstd * (W @ (h * norm_w rounded)), rstd from the
    producer's segment sums (RMSNormLinearParams.post_scale), before its epilogue rounds or transforms it."""
    ss = row_sumsq_ref(h)
    lanes = ss.new_zeros(h.shape[0], 16)
    for c in range(0, ss.shape[1], 16):  # 16-wide chunks added elementwise in order, then the 16 lanes
        chunk = ss[:, c:c + 16]
        lanes[:, :chunk.shape[1]] += chunk
    rstd = 1.0 / torch.sqrt(lanes.sum(-1) / h.shape[1] + eps)
    return (scaled_rows_ref(h, norm_w).float() @ W.float().T) * rstd[:, None]


def stat_segments(k: int) -> int:
    """The SEGS constexpr of a norm launch over rows of k features (k / 16 padded to a multiple of 16)."""
    return triton.cdiv(k // STAT_SEGMENT, 16) * 16


def _flag_with_input(flag: str, on: bool, name: str, t: torch.Tensor | None) -> bool:
    """A launch flag must be a bool, and its input tensor `name` is refused without it. -> the flag."""
    if not isinstance(on, bool):
        raise ValueError(f"{flag}={on!r} must be a bool")
    if not on and t is not None:
        raise ValueError(f"{name} is read only with {flag}=True")
    return on


def check_scaled_x(scaled_x: torch.Tensor | None, post_scale: bool, x: torch.Tensor) -> None:
    """A post-scale norm launch's operand: given exactly when post_scale, x's shape, dtype and device (that
    post_scale comes with producer_stat and without prenorm, RMSNormLinearParams checks)."""
    if not _flag_with_input("post_scale", post_scale, "scaled_x", scaled_x):
        return
    if scaled_x is None:
        raise ValueError("post_scale=True needs scaled_x, the rows times the norm weight that the launch that wrote x "
                         "stored (gemm.linear(..., scale_w=, scaled_out=))")
    if (scaled_x.dtype != x.dtype or scaled_x.shape != x.shape or not scaled_x.is_contiguous()
            or scaled_x.device != x.device):
        raise ValueError(f"scaled_x must be a contiguous {x.dtype} {list(x.shape)} tensor on {x.device}, got "
                         f"{scaled_x.dtype} {list(scaled_x.shape)} on {scaled_x.device}")


def check_row_sumsq(row_sumsq: torch.Tensor | None, producer_stat: bool, x: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
    """A norm launch's producer statistic: given exactly when producer_stat, [T, K / 16] fp32 on x's device, and only
    for rows that are x itself (with a residual the kernel normalises x + residual, which no producer summed)."""
    if not _flag_with_input("producer_stat", producer_stat, "row_sumsq", row_sumsq):
        return
    T, K = x.shape
    if row_sumsq is None:
        raise ValueError("producer_stat=True needs row_sumsq, the sums of squares the launch that wrote x stored "
                         "(gemm.linear(..., row_sumsq_out=))")
    if residual is not None:
        raise ValueError("producer_stat=True normalises x as written: it takes no residual")
    if K % STAT_SEGMENT:
        raise ValueError(f"producer_stat=True needs K a multiple of {STAT_SEGMENT}, got {K}")
    if (row_sumsq.dtype != torch.float32 or tuple(row_sumsq.shape) != (T, K // STAT_SEGMENT)
            or not row_sumsq.is_contiguous() or row_sumsq.device != x.device):
        raise ValueError(f"row_sumsq must be a contiguous float32 [{T}, {K // STAT_SEGMENT}] tensor on {x.device}, "
                         f"got {row_sumsq.dtype} {list(row_sumsq.shape)} on {row_sumsq.device}")


@triton.jit
def normalize(h, nw, rstd):
    """The chunk the projection multiplies, with the dtype roundings of transformers' LlamaRMSNorm: nw fp32 [BLOCK_K],
    rstd [BLOCK_M]."""
    dtype = h.dtype
    hn = (h.to(tl.float32) * rstd[:, None]).to(dtype)
    return (hn.to(tl.float32) * nw[None, :]).to(dtype)


@triton.jit(do_not_specialize=["T"])
def _rms_norm_kernel(x_ptr, r_ptr, nw_ptr, h_ptr, a_ptr, ss_ptr, T, K, eps, HAS_RES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAT_UNROLL: tl.constexpr, PDL: tl.constexpr = 0,
                     STAT_SEGS: tl.constexpr = 0):
    # One program per (row tile, K chunk): each computes its rows' statistic (x is small and in L2) and writes one
    # chunk, so the launch is one round of loads deep, not K / BLOCK_K.
    wait_for_predecessor(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    ks = tl.arange(0, BLOCK_K)
    row_offs = rows.to(tl.int64)[:, None] * K
    kk = pid_k * BLOCK_K + ks
    m = row_ok[:, None] & (kk < K)[None, :]
    h = load_h(x_ptr, r_ptr, row_offs + kk[None, :], m, HAS_RES)  # in flight with the statistic's loads
    nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    if STAT_SEGS > 0:
        rstd = rstd_from_sumsq(ss_ptr, rows, row_ok, K, eps, BLOCK_M, STAT_SEGS)
    else:
        rstd = row_rstd(x_ptr, r_ptr, h_ptr, row_offs, row_ok, ks, pid_k == 0, K, eps, HAS_RES, BLOCK_M, BLOCK_K,
                        STAT_UNROLL)
    release_successor(PDL)
    tl.store(a_ptr + row_offs + kk[None, :], normalize(h, nw, rstd), mask=m)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, round to x.dtype, multiply by the weight in x.dtype."""
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


# K chunks the statistic of rms_norm_rows loads at once (nothing else is live there: up to 16 chunks, one round of
# loads for Llama-3-8B's 4096 features at block_k 256, where the fused kernels' registers allow 8)
NORM_ROWS_UNROLL = 16


def rms_norm_rows(x: torch.Tensor, norm_w: torch.Tensor, eps: float, residual: torch.Tensor | None,
                  residual_out: torch.Tensor | None, *, block_k: int, row_tile: int, num_warps: int,
                  row_sumsq: torch.Tensor | None = None) -> torch.Tensor:
    """The normalised rows [T, K] a norm + projection kernel with these block_k / row_tile would multiply (x,
    residual and their outputs checked by the caller, norm_gemm.check_norm_inputs); h = x + residual to residual_out.
    num_warps: the projection's, so a one-row tile's tl.sum takes the same layout. row_sumsq: the producer's
    segment sums (check_row_sumsq), read instead of x for the statistic."""
    T, K = x.shape
    a = torch.empty_like(x)
    has_res = residual is not None
    unroll = min(NORM_ROWS_UNROLL, triton.next_power_of_2(triton.cdiv(K, block_k)))
    _rms_norm_kernel[(triton.cdiv(T, row_tile), triton.cdiv(K, block_k))](
        x, residual if has_res else x, norm_w, residual_out if has_res else a, a,
        a if row_sumsq is None else row_sumsq, T, K, float(eps), HAS_RES=has_res, BLOCK_M=row_tile, BLOCK_K=block_k,
        STAT_UNROLL=unroll, STAT_SEGS=0 if row_sumsq is None else stat_segments(K), num_warps=num_warps,
        **pdl_launch(x.device))
    return a
