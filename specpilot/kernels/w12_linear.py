"""Projections that read W12 weights (specpilot.weights.format) and decode them inside the matmul.

`w12_linear` and `w12_rmsnorm_linear` are `linear` and `rmsnorm_linear` with the W tile load replaced by a
decode: each [BLOCK_K, BLOCK_N] tile of W is rebuilt in registers as exact bf16 (sign+mantissa byte, exponent
from the row's table, escaped exponents from the escape list) and fed to the same `tl.dot` chain over the same
BLOCK_K chunks, in the same order, with the same prologue and epilogue. So the outputs are bit-identical to the
bf16 kernels on decode(W) for any T, and inherit their batch invariance (T only picks the token tile; block_n,
num_warps, num_stages stay T-neutral). Enabling W12 changes no output token; it only reads 1.5 bytes a weight.

Escapes: a program walks K in ascending chunks, so it keeps, per W row, the index of that row's next escape
(row_esc[n] + escapes already passed). A tile without escapes skips the escape path; a tile with some takes an
integer cumsum over K (exact in any order) and a masked gather. Escape-heavy tensors stay exact, only slower.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from ..weights.format import W12Tensor
from ._common import ACT_DTYPES, BLOCK_M, check_launchable, check_out, check_tensor, is_interpreted
from .gemm import BLOCK_K, LinearParams, default_block_n, default_num_stages, fit_block_n, linear
from .norm_gemm import RMSNormLinearParams, _load_h

ESCAPE = tl.constexpr(15)  # a constexpr global: compiled kernels may only read constexpr globals


@triton.jit
def _w12_tile(lo_ptr, code_ptr, tab_ptr, esc_ptr, lo_cols, code_cols, tab_base, esc_next, kk, m):
    """W^T tile [BLOCK_K, BLOCK_N] as bf16 (masked elements +0.0), and the rows' next escape index after it."""
    lo = tl.load(lo_ptr + lo_cols + kk[:, None], mask=m, other=0).to(tl.int32)
    byte = tl.load(code_ptr + code_cols + (kk // 2)[:, None], mask=m, other=0).to(tl.int32)
    code = (byte >> ((kk % 2) * 4)[:, None]) & 15
    ex = tl.load(tab_ptr + tab_base + code).to(tl.int32)
    esc = (code == ESCAPE).to(tl.int32)  # masked elements loaded code 0: never an escape
    if tl.max(tl.max(esc, axis=1), axis=0) > 0:
        # rank of each escape among its row's escapes: exclusive prefix count down K (integers: exact)
        rank = esc_next[None, :] + tl.cumsum(esc, axis=0) - esc
        ex = tl.where(esc != 0, tl.load(esc_ptr + rank, mask=esc != 0, other=0).to(tl.int32), ex)
        esc_next += tl.sum(esc, axis=0)
    ex = tl.where(m, ex, 0)  # a masked element must be +0.0 (table[0] may be 255: 0 * inf would poison the dot)
    bits = ((lo & 0x80) << 8) | (ex << 7) | (lo & 0x7F)
    # The reduction (a no-op) hides the 8-bit loads above from Triton's operand-width heuristic: seen through,
    # they gave this kernel's dots kWidth=4 operands (another K order inside the MMA) where the bf16 kernels
    # have kWidth=2, and on an H200 the W12 GEMM parted from the bf16 one at T=16 (tests/test_kernel_codegen.py).
    bits = tl.max(bits[:, :, None], axis=2)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), esc_next


@triton.jit
def _w12_cols(rowtab_ptr, rowesc_ptr, cols, col_ok, K, KC):
    """Per output column (a W row): byte offsets of its lo and code rows, its table's offset, its first escape."""
    c64 = cols.to(tl.int64)
    tab = tl.load(rowtab_ptr + cols, mask=col_ok, other=0) * 16
    first_esc = tl.load(rowesc_ptr + cols, mask=col_ok, other=0)
    return c64[None, :] * K, c64[None, :] * KC, tab[None, :], first_esc


@triton.jit(do_not_specialize=["T"])
def _w12_linear_kernel(x_ptr, lo_ptr, code_ptr, tab_ptr, rowtab_ptr, rowesc_ptr, esc_ptr, b_ptr, r_ptr, y_ptr,
                       T, N, K, KC, stride_x, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # the body of gemm._linear_kernel (bf16, no SwiGLU prologue) with the W load replaced by _w12_tile
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    lo_cols, code_cols, tab_base, esc_next = _w12_cols(rowtab_ptr, rowesc_ptr, cols, col_ok, K, KC)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w, esc_next = _w12_tile(lo_ptr, code_ptr, tab_ptr, esc_ptr, lo_cols, code_cols, tab_base, esc_next, kk,
                                k_ok[:, None] & col_ok[None, :])
        acc = tl.dot(a, w, acc, input_precision="tf32")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    om = row_ok[:, None] & col_ok[None, :]
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=om, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=om)


@triton.jit(do_not_specialize=["T"])
def _w12_rmsnorm_linear_kernel(x_ptr, r_ptr, nw_ptr, lo_ptr, code_ptr, tab_ptr, rowtab_ptr, rowesc_ptr, esc_ptr,
                               b_ptr, y_ptr, h_ptr, T, N, K, KC, eps, HAS_RES: tl.constexpr,
                               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    # the body of norm_gemm._rmsnorm_linear_kernel with the W load replaced by _w12_tile
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    row_offs = rows.to(tl.int64)[:, None] * K
    dtype = x_ptr.dtype.element_ty

    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        xm = row_ok[:, None] & (kk < K)[None, :]
        h = _load_h(x_ptr, r_ptr, row_offs + kk[None, :], xm, HAS_RES)
        if HAS_RES:
            tl.store(h_ptr + row_offs + kk[None, :], h, mask=xm & (pid_n == 0))
        hf = h.to(tl.float32)
        sq += hf * hf
    ones = tl.full([BLOCK_K, 16], 1.0, tl.float32)
    ss = tl.max(tl.dot(sq, ones, input_precision="ieee"), axis=1)
    rstd = 1.0 / tl.sqrt_rn(ss / K + eps)

    lo_cols, code_cols, tab_base, esc_next = _w12_cols(rowtab_ptr, rowesc_ptr, cols, col_ok, K, KC)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        xm = row_ok[:, None] & k_ok[None, :]
        h = _load_h(x_ptr, r_ptr, row_offs + kk[None, :], xm, HAS_RES)
        nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        hn = (h.to(tl.float32) * rstd[:, None]).to(dtype)
        a = (hn.to(tl.float32) * nw[None, :]).to(dtype)
        w, esc_next = _w12_tile(lo_ptr, code_ptr, tab_ptr, esc_ptr, lo_cols, code_cols, tab_base, esc_next, kk,
                                k_ok[:, None] & col_ok[None, :])
        acc = tl.dot(a, w, acc, input_precision="tf32")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_w12(W: Any, K: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """W's kernel arrays (lo, codes, tables, row_table, row_esc, escapes or a stand-in pointer when empty)."""
    if not isinstance(W, W12Tensor):
        raise ValueError(f"W must be a W12Tensor (specpilot.weights.encode), got {type(W).__name__}")
    if len(W.shape) != 2 or W.cols != K:
        raise ValueError(f"W must have shape [N, {K}], got {list(W.shape)}")
    if W.device != device:
        raise ValueError(f"W is on {W.device} but x is on {device}")
    esc = W.escapes if W.escapes.numel() else W.lo  # never dereferenced when there are no escapes
    return W.lo, W.codes, W.tables, W.row_table, W.row_esc, esc


def _check_common(x: torch.Tensor, W: Any, bias, out_dtype) -> tuple[int, int, int, torch.dtype, tuple]:
    check_tensor("x", x, (None, None), torch.bfloat16)  # W12 decodes to bf16: the dot needs bf16 activations
    T, K = x.shape
    if T < 1 or K < 1:
        raise ValueError(f"x must be [T >= 1, K >= 1], got {list(x.shape)}")
    arrays = _check_w12(W, K, x.device)
    N = W.rows
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"out_dtype must be one of {ACT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, (N,), x.dtype, x.device)
    return T, K, N, out_dtype, arrays


def w12_linear(x: torch.Tensor, W: W12Tensor, residual: torch.Tensor | None = None, *,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
               block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """linear(x, decode(W), residual, ...) bit for bit, reading W as W12. x [T, K] bf16, W [N, K]."""
    LinearParams(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    T, K, N, out_dtype, arrays = _check_common(x, W, bias, out_dtype)
    if residual is not None:
        check_tensor("residual", residual, (T, N), out_dtype, x.device)
    check_launchable(_w12_linear_kernel, x.device)
    out = check_out("out", out, (T, N), out_dtype, x.device)
    bn = default_block_n(N, T) if block_n is None else block_n
    stages = default_num_stages(bn, x.element_size()) if num_stages is None else num_stages
    grid = (triton.cdiv(T, BLOCK_M) * triton.cdiv(N, bn),)
    _w12_linear_kernel[grid](x, *arrays, x if bias is None else bias,
                             x if residual is None else residual, out, T, N, K, W.codes.shape[1], x.shape[1],
                             HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_M=BLOCK_M,
                             BLOCK_N=bn, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=stages)
    return out


def w12_rmsnorm_linear(x: torch.Tensor, norm_w: torch.Tensor, W: W12Tensor, eps: float,
                       residual: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None, block_n: int | None = None, num_warps: int = 8,
                       num_stages: int | None = None, block_k: int = BLOCK_K):
    """rmsnorm_linear(x, norm_w, decode(W), eps, residual, ...) bit for bit, reading W as W12."""
    RMSNormLinearParams(block_n=block_n, num_warps=num_warps, num_stages=num_stages, block_k=block_k)
    T, K, N, out_dtype, arrays = _check_common(x, W, bias, out_dtype)
    dev = x.device
    check_tensor("norm_w", norm_w, (K,), x.dtype, dev)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    if residual is not None:
        check_tensor("residual", residual, (T, K), x.dtype, dev)
        residual_out = check_out("residual_out", residual_out, (T, K), x.dtype, dev)
    elif residual_out is not None:
        raise ValueError("residual_out is only written when residual is given")
    check_launchable(_w12_rmsnorm_linear_kernel, dev)
    out = check_out("out", out, (T, N), out_dtype, dev)
    bn = fit_block_n(default_block_n(N, T, target_programs=64), block_k, 2) if block_n is None else block_n
    stages = default_num_stages(bn, x.element_size(), most=4, block_k=block_k) if num_stages is None else num_stages
    grid = (triton.cdiv(T, BLOCK_M) * triton.cdiv(N, bn),)
    has_res = residual is not None
    _w12_rmsnorm_linear_kernel[grid](x, residual if has_res else x, norm_w, *arrays, x if bias is None else bias,
                                     out, residual_out if has_res else out, T, N, K, W.codes.shape[1], float(eps),
                                     HAS_RES=has_res, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=bn,
                                     BLOCK_K=block_k, num_warps=num_warps, num_stages=stages)
    return out if residual is None else (out, residual_out)


LLAMA3_8B_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (128256, 4096))  # [N, K]: q/o, down, gate|up half, head


def bench_w12(shapes: Sequence[tuple[int, int]] = LLAMA3_8B_SHAPES, tokens: Sequence[int] = (1, 16), *,
              device: str | torch.device = "cuda", reps: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """GPU: median us of w12_linear against the bf16 `linear` per ([N, K], T), on randn * 0.02 bf16 weights.

    Timed as CUDA-graph replays over enough weight copies to exceed the L2 cache four times (weights from HBM).
    Each row also checks that the W12 output equals `linear` on the decoded weights bit for bit.
    """
    from ..weights.format import decode, encode
    from .bench import time_graph

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"bench_w12 needs a CUDA GPU (device={dev}, cuda available={torch.cuda.is_available()})")
    if is_interpreted(_w12_linear_kernel):
        raise RuntimeError("bench_w12 cannot time kernels built under TRITON_INTERPRET=1; unset it first")
    g = torch.Generator(device=dev).manual_seed(seed)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows: list[dict[str, Any]] = []
    for N, K in shapes:
        copies = max(1, min(16, -(-4 * l2 // (N * K * 2))))
        Ws = [(torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        Qs = [encode(W) for W in Ws]
        for T in tokens:
            x = (torch.randn(T, K, generator=g, device=dev)).to(torch.bfloat16)
            if not torch.equal(w12_linear(x, Qs[0]).view(torch.int16), linear(x, decode(Qs[0])).view(torch.int16)):
                raise RuntimeError(f"w12_linear differs from linear at [N, K]=[{N}, {K}], T={T}")
            ms = time_graph([lambda Q=Q: w12_linear(x, Q) for Q in Qs], reps)
            ref_ms = time_graph([lambda W=W: linear(x, W) for W in Ws], reps)
            st = Qs[0].stats
            rows.append({"N": N, "K": K, "tokens": T, "w12_us": ms * 1e3, "bf16_us": ref_ms * 1e3,
                         "speedup": ref_ms / ms, "w12_gbps": st.kernel_bytes / ms / 1e6,
                         "bf16_gbps": N * K * 2 / ref_ms / 1e6, "bytes_per_weight": st.bytes_per_weight,
                         "escape_rate": st.escape_rate, "copies": copies})
        del Ws, Qs
    return rows


def format_w12_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>7}{'K':>7}{'T':>4}{'w12 us':>9}{'bf16 us':>9}{'x bf16':>8}{'w12 GB/s':>10}{'bf16 GB/s':>10}"
             f"{'B/w':>8}{'esc rate':>10}"]
    lines += [f"{r['N']:>7}{r['K']:>7}{r['tokens']:>4}{r['w12_us']:>9.1f}{r['bf16_us']:>9.1f}{r['speedup']:>8.2f}"
              f"{r['w12_gbps']:>10.0f}{r['bf16_gbps']:>10.0f}{r['bytes_per_weight']:>8.4f}{r['escape_rate']:>10.2e}"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m specpilot.kernels.w12_linear [T ...]  (Llama-3-8B shapes, on a GPU)
    import sys

    print(format_w12_table(bench_w12(LLAMA3_8B_SHAPES, [int(v) for v in sys.argv[1:]] or [1, 16])))
