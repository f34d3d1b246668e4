"""W12 weights (specpilot.weights.format) read by the projection kernels, decoded inside the matmul.

`linear`, `swiglu_linear`, `rmsnorm_linear`, `rmsnorm_qkv_rope` and `rmsnorm_glu` take W either as a bf16 tensor
or as a W12Tensor. With W12 their kernels swap one statement, the W tile load, for `w12_tile`: each
[BLOCK_K, BLOCK_N] tile of W is rebuilt in registers as exact bf16 (sign+mantissa byte, exponent from the row's
table, escaped exponents from the escape list) and fed to the same dot chain, in the same K order, with the same
prologue and epilogue. One kernel body for both formats, so the outputs are bit-identical to the bf16 ones on
decode(W) for any T, batch invariance included; enabling W12 changes no output token, only the bytes read (1.5 a
weight).

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
from ._common import check_tensor, is_interpreted

ESCAPE = tl.constexpr(15)  # a constexpr global: compiled kernels may only read constexpr globals


@triton.jit
def w12_tile(lo_ptr, code_ptr, tab_ptr, esc_ptr, lo_cols, code_cols, tab_base, esc_next, kk, m):
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
def w12_cols(rowtab_ptr, rowesc_ptr, cols, col_ok, K, KC):
    """Per output column (a W row): byte offsets of its lo and code rows, its table's offset, its first escape."""
    c64 = cols.to(tl.int64)
    tab = tl.load(rowtab_ptr + cols, mask=col_ok, other=0) * 16
    first_esc = tl.load(rowesc_ptr + cols, mask=col_ok, other=0)
    return c64[None, :] * K, c64[None, :] * KC, tab[None, :], first_esc


def weight_operand(W: Any, K: int, dtype: torch.dtype, device: torch.device, rows_per_out: int = 1
                   ) -> tuple[tuple, bool, int]:
    """A projection's W, bf16/fp16/fp32 [N, K] or W12Tensor [N, K], as the kernels take it: (the arguments w_ptr,
    lo_ptr, code_ptr, tab_ptr, rowtab_ptr, rowesc_ptr, esc_ptr, KC; the W12 flag; N). A W12 W decodes to bf16,
    so the activations must be bf16 too."""
    if isinstance(W, W12Tensor):
        if dtype != torch.bfloat16:
            raise ValueError(f"W12 weights decode to bf16: x must have dtype torch.bfloat16, got {dtype}")
        if len(W.shape) != 2 or W.cols != K:
            raise ValueError(f"W must have shape [N, {K}], got {list(W.shape)}")
        if W.device != device:
            raise ValueError(f"W is on {W.device} but x is on {device}")
        esc = W.escapes if W.escapes.numel() else W.lo  # never dereferenced when there are no escapes
        args, w12, n = (W.lo, W.lo, W.codes, W.tables, W.row_table, W.row_esc, esc, W.codes.shape[1]), True, W.rows
    else:
        check_tensor("W", W, (None, K), dtype, device)
        args, w12, n = (W,) * 7 + (1,), False, W.shape[0]  # the W12 pointers are never read
    if n < 1 or n % rows_per_out:
        raise ValueError(f"W must have a positive multiple of {rows_per_out} rows, got {n}")
    return args, w12, n


LLAMA3_8B_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (128256, 4096))  # [N, K]: q/o, down, gate|up half, head


def bench_w12(shapes: Sequence[tuple[int, int]] = LLAMA3_8B_SHAPES, tokens: Sequence[int] = (1, 16), *,
              device: str | torch.device = "cuda", reps: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """GPU: median us of `linear` on W12 weights against `linear` on bf16 per ([N, K], T), on randn * 0.02 bf16 weights.

    Timed as CUDA-graph replays over enough weight copies to exceed the L2 cache four times (weights from HBM).
    Each row also checks that the W12 output equals the bf16 one on the decoded weights bit for bit.
    """
    from ..weights.format import decode, encode
    from .bench import time_graph
    from .gemm import _linear_kernel, linear

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"bench_w12 needs a CUDA GPU (device={dev}, cuda available={torch.cuda.is_available()})")
    if is_interpreted(_linear_kernel):
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
            if not torch.equal(linear(x, Qs[0]).view(torch.int16), linear(x, decode(Qs[0])).view(torch.int16)):
                raise RuntimeError(f"linear on W12 differs from linear on bf16 at [N, K]=[{N}, {K}], T={T}")
            ms = time_graph([lambda Q=Q: linear(x, Q) for Q in Qs], reps)
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


if __name__ == "__main__":  # python -m specpilot.kernels.w12_tile [T ...]  (Llama-3-8B shapes, on a GPU)
    import sys

    print(format_w12_table(bench_w12(LLAMA3_8B_SHAPES, [int(v) for v in sys.argv[1:]] or [1, 16])))
