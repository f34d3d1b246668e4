"""W12 weights read by the projection kernels in the oct layout (specpilot.weights.oct), decoded inside the matmul.

`linear`, `swiglu_linear`, `rmsnorm_linear`, `rmsnorm_qkv_rope` and `rmsnorm_glu` take W either as a bf16 tensor
or as a W12 tensor: an OctLayout (what the engine holds), or a W12Tensor, converted by oct_layout on every call.
With W12 their K loop walks 256-element blocks: `oct_block` rebuilds a block of the tile's W rows in registers as
eight exact bf16 [32, BLOCK_N] slices (sign+mantissa bytes, exponent = the row's base + a 4-bit code + 16 x a high
nibble where the cell has escapes), and each slice meets its 32 x columns in one dot, in ascending K. A GPU MMA
rounds once per 16-wide K step, so these dots give the bits of the bf16 kernels' 128-wide ones (the interpreter's
dot does the same, kernels/_common.py); same prologue, epilogue and split-K order: outputs bit-identical to the
bf16 ones on decode(W) for any T, batch invariance included. W12 changes no output token, only the bytes read
(~1.52 a weight).

The decode (measured in scripts/gpu_w12_variants.py, scripts/gpu_ncu_w12.py, notes/h200.md sessions 13, 28-30), as
inline PTX (Triton's own integer ops made it ALU-bound): per two weights one `prmt` spreads two sign+mantissa bytes
over two bf16 halves, an and and a multiply-add place base + code + 16 x high nibble at each half's exponent (codes
and high nibbles interleaved into bytes by two merges a word, shared by four outputs), one `lop3` merges them: five
instructions (_oct_asm). One asm instance decodes a lane pair (pack=2: two consecutive K of a column, one MMA operand
register), which is why the code words go by lane pairs (weights/oct.py). Escapes (exponents outside the row's
16-wide window) ride on the same add: a cell (row, 256-block) that holds any has a word of high exponent nibbles per
lane (OctLayout.fat), loaded under a mask that is false for the ~98% of cells without.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import torch
import triton
import triton.language as tl

from ..weights.format import W12Tensor
from ..weights.oct import BLOCK, OctLayout, oct_layout
from ._common import check_tensor, is_interpreted

OCT_BLOCK = tl.constexpr(BLOCK)  # K elements a block: eight 32-wide slices (constexpr globals only, in kernels)
OCT_ROW_BLOCK_BYTES = BLOCK * 3 // 2 + 32 * 4 + 4  # one W row's block: words, codes, high nibbles, cell index


def _oct_asm() -> str:
    """The decode of one lane pair (2i, 2i + 1) of a block's tile column, as inline PTX for pack=2.

    Inputs ($8..$17, two registers an argument: lane 2i's element, then 2i + 1's): lo words La, Lb (byte q: slice q,
    resp. 4 + q), the pair's code words (2i: slices 0-3, 2i + 1: slices 4-7; nibble q lane 2i's, q + 4 lane 2i + 1's,
    weights/oct.py), its high-nibble words (the same positions; zero where the cell has no escapes), the row's base at
    bits 7 and 23 (twice). Output e ($0..$7): slice e's two bf16, lane 2i low, 2i + 1 high: one MMA operand
    register as it stands.
    Per code word and its high-nibble word, two merges interleave their nibbles into bytes (code | high << 4: the
    exponent's offset from the base): `xe` holds slices q = 0, 2 (bytes: q = 0 lane 2i, q = 2 lane 2i, q = 0 lane
    2i + 1, q = 2 lane 2i + 1), `xo` slices 1, 3. Per output: an and keeps its two bytes, a multiply-add moves them
    to bits 7 and 23 onto the base (right shifts are mad.hi; ptxas makes each a LEA), which gives each half's
    exponent (mod 256: a carry out of a half only reaches its bit 15 or the word's top, which the merge drops); one
    byte permute spreads [lo, lo, lo', lo'] over the two halves, one lop3 takes sign and mantissa from it, the
    exponent from the sum. Five instructions per two weights (session 30: eight and a repacking permute, then six)."""
    lines = [".reg .b32 t, x, y, u, m, n, xe, xo;", "mov.b32 m, 0x807F807F;", "mov.b32 n, 0x0F0F0F0F;"]
    for half, (lo0, lo1, code, high) in enumerate((("$8", "$9", "$12", "$14"), ("$10", "$11", "$13", "$15"))):
        lines.append(f"shl.b32 x, {high}, 4; lop3.b32 xe, {code}, n, x, 0xE2; "  # (code & n) | (high << 4 & ~n)
                     f"shr.u32 y, {code}, 4; lop3.b32 xo, y, n, {high}, 0xE2;")  # (code >> 4 & n) | (high & ~n)
        for q in range(4):
            x, bytes_, move = ("xe" if q % 2 == 0 else "xo"), (0x00FF00FF if q < 2 else 0xFF00FF00), (
                "mad.lo.u32 u, u, 0x80, $16;" if q < 2 else "mad.hi.u32 u, u, 0x80000000, $16;")  # << 7 / >> 1
            sel = 0x4400 + 0x1111 * q  # bytes q, q of lane 2i's lo word, then of lane 2i + 1's
            lines.append(f"and.b32 u, {x}, {bytes_:#010x}; {move} prmt.b32 t, {lo0}, {lo1}, {sel:#06x}; "
                         f"lop3.b32 ${4 * half + q}, t, m, u, 0xE2;")
    return "{\n" + "\n".join(lines) + "\n}"


OCT_ASM = tl.constexpr(_oct_asm())
OCT_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 10))


@triton.jit
def _oct_lane(L, C, H, b2, q: tl.constexpr, odd):
    """The interpreter's decode of each lane's element of slice q (or 4 + q): byte q of its lo word L, code and high
    nibble at nibble q (even lane) or q + 4 (odd lane) of its pair's words C, H. The asm's bits from plain integer
    ops."""
    s = 4 * q + 16 * odd
    ex = ((b2 >> 7) & 0xFF) + ((C >> s) & 15) + 16 * ((H >> s) & 15)
    byte = (L >> (8 * q)) & 0xFF
    return (((byte & 0x80) << 8) | ((ex & 0xFF) << 7) | (byte & 0x7F)).to(tl.uint16).to(tl.bfloat16, bitcast=True)


W12Weight = Union[OctLayout, W12Tensor]  # what the projection kernels take for W besides a dense tensor

_COMPILED = tl.constexpr(not is_interpreted(_oct_lane))  # the interpreter runs no PTX


@triton.jit
def oct_decode(La, Lb, Cw, H, b2):
    """Eight bf16 [32, BLOCK_N] slices from a block's words, compiled kernels only (OCT_ASM): one asm instance a lane
    pair (pack=2), so the pair's two code and high-nibble words arrive together."""
    return tl.inline_asm_elementwise(OCT_ASM, OCT_CONSTRAINTS, [La, Lb, Cw, H, b2], dtype=(tl.bfloat16,) * 8,
                                     is_pure=True, pack=2)


@triton.jit
def oct_cols(base_ptr, cols, col_ok, Kp):
    """Per W row of a tile: (rows as int64 [1, BLOCK_N], the row's base at bits 7 and 23 [32, BLOCK_N], index of the
    row's first cell). Rows past N read as zeros and decode to +0.0."""
    base = tl.load(base_ptr + cols, mask=col_ok, other=0)
    b2 = ((base << 7) | (base << 23))[None, :] + tl.zeros([32, 1], dtype=tl.int32)
    return cols.to(tl.int64)[None, :], b2, cols * (Kp // OCT_BLOCK)


@triton.jit
def oct_cell(fcell_ptr, cells, col_ok, k0, Kp):
    """The tile's rows' cell indices (OctLayout.fat_cells) of the block at k0 (the last block's past Kp, so a loop may
    ask for the block after its last). A K loop loads the next block's one
    iteration ahead and carries it: the high nibbles' address then comes from no load of the same iteration, so
    Triton's pipeliner sees no indirect load and prefetches every operand num_stages - 1 blocks ahead (an indirect
    load halves that distance: (num_stages - 1) // 2, one block at 2-4 stages; session 30)."""
    return tl.load(fcell_ptr + cells + tl.minimum(k0, Kp - OCT_BLOCK) // OCT_BLOCK, mask=col_ok, other=-1)


@triton.jit
def oct_block(words_ptr, codes_ptr, fat_ptr, w_rows, b2, f, col_ok, k0, Kp):
    """W^T over K [k0, k0 + 256) of the tile's rows as eight bf16 [32, BLOCK_N] slices, K ascending (exact): the
    block's words, and for a cell with escapes (f, oct_cell's, >= 0) its high nibbles (a masked load: cells without
    escapes read nothing more). No data-dependent control flow, so Triton can pipeline the caller's loop. (Loading
    the next block's words here by hand made the H200 GEMVs 1.4-2x slower: session 28.)"""
    j = tl.arange(0, 32)
    m = col_ok[None, :]
    La = tl.load(words_ptr + w_rows * (Kp // 4) + k0 // 4 + j[:, None], mask=m, other=0)
    Lb = tl.load(words_ptr + w_rows * (Kp // 4) + k0 // 4 + 32 + j[:, None], mask=m, other=0)
    codes = codes_ptr + w_rows * (Kp // 8) + k0 // 8
    fat = fat_ptr + (f.to(tl.int64) * 32)[None, :]
    fm = m & (f >= 0)[None, :]
    if _COMPILED:
        return oct_decode(La, Lb, tl.load(codes + j[:, None], mask=m, other=0),
                          tl.load(fat + j[:, None], mask=fm, other=0), b2)
    else:  # each lane reads its pair's words: 2i (slices 0-3) and 2i + 1 (slices 4-7)
        even = (j - (j & 1))[:, None]
        odd = (j & 1)[:, None]
        C0 = tl.load(codes + even, mask=m, other=0)
        C1 = tl.load(codes + even + 1, mask=m, other=0)
        H0 = tl.load(fat + even, mask=fm, other=0)
        H1 = tl.load(fat + even + 1, mask=fm, other=0)
        return (_oct_lane(La, C0, H0, b2, 0, odd), _oct_lane(La, C0, H0, b2, 1, odd),
                _oct_lane(La, C0, H0, b2, 2, odd), _oct_lane(La, C0, H0, b2, 3, odd),
                _oct_lane(Lb, C1, H1, b2, 0, odd), _oct_lane(Lb, C1, H1, b2, 1, odd),
                _oct_lane(Lb, C1, H1, b2, 2, odd), _oct_lane(Lb, C1, H1, b2, 3, odd))


def as_oct(W: OctLayout | W12Tensor) -> OctLayout:
    """The kernels' layout of a W12 weight (a W12Tensor is converted: hold the OctLayout to convert once)."""
    return W if isinstance(W, OctLayout) else oct_layout(W)


def weight_operand(W: Any, K: int, dtype: torch.dtype, device: torch.device, rows_per_out: int = 1
                   ) -> tuple[tuple, bool, int]:
    """A projection's W, bf16/fp16/fp32 [N, K], or W12 [N, K] (OctLayout or W12Tensor), as the kernels take it:
    (the arguments w_ptr, words_ptr, codes_ptr, base_ptr, fcell_ptr, fat_ptr, Kp; the W12 flag; N). A W12 W
    decodes to bf16, so the activations must be bf16 too."""
    if isinstance(W, (W12Tensor, OctLayout)):
        if dtype != torch.bfloat16:
            raise ValueError(f"W12 weights decode to bf16: x must have dtype torch.bfloat16, got {dtype}")
        if len(W.shape) != 2 or W.shape[1] != K:
            raise ValueError(f"W must have shape [N, {K}], got {list(W.shape)}")
        o = as_oct(W)
        if o.words.device != device:
            raise ValueError(f"W is on {o.words.device} but x is on {device}")
        fat = o.fat if o.fat.numel() else o.words  # never dereferenced when no cell has escapes
        args, w12, n = (o.words, o.words, o.codes, o.base, o.fat_cells, fat, o.padded_cols), True, o.shape[0]
    else:
        check_tensor("W", W, (None, K), dtype, device)
        args, w12, n = (W,) * 6 + (1,), False, W.shape[0]  # the W12 pointers are never read
    if n < 1 or n % rows_per_out:
        raise ValueError(f"W must have a positive multiple of {rows_per_out} rows, got {n}")
    return args, w12, n


def check_w12_launch(w12: bool, row_tile: int, k_split: int, k: int) -> None:
    """W12's dots are 32 wide: the bits of the bf16 kernel's chunks only through MMA tiles (16-row tiles; one-row
    tiles sum each chunk with tl.sum, whose tree follows the chunk width), and split-K runs of whole blocks."""
    if not w12:
        return
    if row_tile != 16:
        raise ValueError(f"W12 weights need row_tile=16 and tile_rows=16 (got {row_tile} rows a program): one-row "
                         "tiles reduce 128-wide chunks; 32-row W12 tiles are not checked to compile the bf16 dots")
    if k_split < k and k_split % BLOCK:
        raise ValueError(f"with W12 weights each split-K run must hold whole {BLOCK}-element blocks, got "
                         f"{k_split} elements a run (K={k}); pick another split_k or block_k")


LLAMA3_8B_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (128256, 4096))  # [N, K]: q/o, down, gate|up half, head


def bench_w12(shapes: Sequence[tuple[int, int]] = LLAMA3_8B_SHAPES, tokens: Sequence[int] = (1, 16), *,
              split_ks: Sequence[int] = (1, 4),
              device: str | torch.device = "cuda", reps: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """GPU: median us of `linear` on W12 weights against `linear` on bf16 per ([N, K], T), on randn * 0.02 bf16 weights.

    Timed as CUDA-graph replays over enough weight copies to exceed the L2 cache four times (weights from HBM).
    Each row also checks that the W12 output equals the bf16 one on the decoded weights bit for bit.
    """
    from ..weights.format import encode
    from ..weights.oct import decode_oct
    from .bench import l2_copies, time_graph
    from .gemm import _linear_kernel, linear

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"bench_w12 needs a CUDA GPU (device={dev}, cuda available={torch.cuda.is_available()})")
    if is_interpreted(_linear_kernel):
        raise RuntimeError("bench_w12 cannot time kernels built under TRITON_INTERPRET=1; unset it first")
    g = torch.Generator(device=dev).manual_seed(seed)
    rows: list[dict[str, Any]] = []
    for N, K in shapes:
        copies = l2_copies(N * K * 2, dev)
        Ws = [(torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        Qs = [oct_layout(encode(W)) for W in Ws]
        for T in tokens:
            x = (torch.randn(T, K, generator=g, device=dev)).to(torch.bfloat16)
            for split in split_ks:
                if not torch.equal(linear(x, Qs[0], split_k=split).view(torch.int16),
                                   linear(x, decode_oct(Qs[0]), split_k=split).view(torch.int16)):
                    raise RuntimeError(f"linear on W12 differs from linear on bf16 at [N, K]=[{N}, {K}], T={T}, "
                                       f"split_k={split}")
                ms = time_graph([lambda Q=Q: linear(x, Q, split_k=split) for Q in Qs], reps)
                ref_ms = time_graph([lambda W=W: linear(x, W, split_k=split) for W in Ws], reps)
                o = Qs[0]
                rows.append({"N": N, "K": K, "tokens": T, "split_k": split, "w12_us": ms * 1e3,
                             "bf16_us": ref_ms * 1e3, "speedup": ref_ms / ms, "w12_gbps": o.kernel_bytes / ms / 1e6,
                             "bf16_gbps": N * K * 2 / ref_ms / 1e6, "bytes_per_weight": o.kernel_bytes / (N * K),
                             "escape_rate": o.escapes / (N * K), "copies": copies})
        del Ws, Qs
    return rows


def format_w12_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>7}{'K':>7}{'T':>4}{'split':>6}{'w12 us':>9}{'bf16 us':>9}{'x bf16':>8}{'w12 GB/s':>10}"
             f"{'bf16 GB/s':>10}{'B/w':>8}{'esc rate':>10}"]
    lines += [f"{r['N']:>7}{r['K']:>7}{r['tokens']:>4}{r['split_k']:>6}{r['w12_us']:>9.1f}{r['bf16_us']:>9.1f}"
              f"{r['speedup']:>8.2f}"
              f"{r['w12_gbps']:>10.0f}{r['bf16_gbps']:>10.0f}{r['bytes_per_weight']:>8.4f}{r['escape_rate']:>10.2e}"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m specpilot.kernels.w12_tile [T ...]  (Llama-3-8B shapes, on a GPU)
    import sys

    print(format_w12_table(bench_w12(LLAMA3_8B_SHAPES, [int(v) for v in sys.argv[1:]] or [1, 16])))
