"""Experiment: the W12 GEMV in Gluon, its decode written straight into the MMA operand registers.

The package's Triton W12 kernels (kernels/w12_tile.py) decode a [32, BLOCK_N] slice in a blocked layout; Triton then
moves it through shared memory into the MMA's B-operand layout (STS + LDSM per slice), and escape-free that decode
runs at only 1.0-1.2x of bf16 (notes/h200.md, session 29). Here the oct words are loaded directly in the B-operand
layout (mma.sync m16n8k16, kWidth 2: a thread holds K rows 2(lane % 4) + {0, 1} (+8, +16, +24) of its columns), so
the decode's outputs already are the operands: no shared memory for W. Same MMA (version 2.0, warps [1, num_warps],
instr [16, 8]) and the same 32-wide K slices in ascending K as the package's W12 and bf16 `linear`: the outputs
should equal the package's bit for bit (checked per shape on the GPU). No split-K, no bias or residual, no software
pipelining yet: this measures the layout alone.

python3 scripts/gpu_w12_gluon.py OUT.json [--shapes 4096x4096,14336x4096] [--tokens 1,16]   (H200)
python3 scripts/gpu_w12_gluon.py --compile-only   (any machine: sm_90 SASS opcode counts, e.g. no STS/LDSM for W)
"""
from __future__ import annotations

import argparse
import itertools
import json
import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from specpilot.kernels.w12_tile import OCT_ASM, OCT_CONSTRAINTS

TILE_M = 16  # token rows per program (the package's row tile)


@gluon.jit
def _decode(La, Lb, Cw, H, b2):
    return gl.inline_asm_elementwise(OCT_ASM, OCT_CONSTRAINTS, [La, Lb, Cw, H, b2], dtype=(gl.bfloat16,) * 8,
                                     is_pure=True, pack=2)


@gluon.jit
def _load_block(words_ptr, codes_ptr, fcell_ptr, fat_ptr, nrow, jj, m, n_ok, cells, k0, Kp, EVEN: gl.constexpr):
    """Block k0's oct words of the tile (lo bytes x2, codes, high nibbles where the cell has escapes), each [32,
    BLOCK_N] in the B-operand layout of nrow / jj. EVEN: every column of the tile exists and K is whole blocks (no
    column or K masks)."""
    if EVEN:
        La = gl.load(words_ptr + nrow * (Kp // 4) + k0 // 4 + jj)
        Lb = gl.load(words_ptr + nrow * (Kp // 4) + k0 // 4 + 32 + jj)
        Cw = gl.load(codes_ptr + nrow * (Kp // 8) + k0 // 8 + jj)
        f = gl.load(fcell_ptr + cells + k0 // 256)
        H = gl.load(fat_ptr + gl.expand_dims(f.to(gl.int64) * 32, 0) + jj, mask=gl.expand_dims(f >= 0, 0) & m,
                    other=0)
    else:
        La = gl.load(words_ptr + nrow * (Kp // 4) + k0 // 4 + jj, mask=m, other=0)
        Lb = gl.load(words_ptr + nrow * (Kp // 4) + k0 // 4 + 32 + jj, mask=m, other=0)
        Cw = gl.load(codes_ptr + nrow * (Kp // 8) + k0 // 8 + jj, mask=m, other=0)
        f = gl.load(fcell_ptr + cells + k0 // 256, mask=n_ok, other=-1)
        H = gl.load(fat_ptr + gl.expand_dims(f.to(gl.int64) * 32, 0) + jj, mask=m & gl.expand_dims(f >= 0, 0),
                    other=0)
    return La, Lb, Cw, H


@gluon.jit
def _w12_gemv_kernel(x_ptr, words_ptr, codes_ptr, base_ptr, fcell_ptr, fat_ptr, y_ptr, T, N, K, Kp,
                     BLOCK_N: gl.constexpr, WARPS: gl.constexpr, PREFETCH: gl.constexpr, EVEN: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    # W side, in the B-operand layout: lane word j of a block is K row j of every slice
    j = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, b_l))
    n_ok = n < N
    m = gl.expand_dims(n_ok, 0) & gl.expand_dims(j < 32, 1)
    nrow = gl.expand_dims(n.to(gl.int64), 0)
    jj = gl.expand_dims(j, 1)
    base = gl.load(base_ptr + n, mask=n_ok, other=0)
    b2 = gl.expand_dims((base << 7) | (base << 23), 0) + gl.zeros([32, BLOCK_N], gl.int32, layout=b_l)
    cells = n * (Kp // 256)
    # x side, in the A-operand layout
    r = pid_m * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, a_l))
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
    xrow = gl.expand_dims(r.to(gl.int64) * K, 1)
    r_ok = gl.expand_dims(r < T, 1)
    acc = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    if PREFETCH:  # block k0 + 256's words loaded while block k0 decodes (registers, by hand: no Gluon pipeliner)
        La, Lb, Cw, H = _load_block(words_ptr, codes_ptr, fcell_ptr, fat_ptr, nrow, jj, m, n_ok, cells, 0, Kp, EVEN)
    for k0 in range(0, Kp, 256):
        if PREFETCH:
            nLa, nLb, nCw, nH = _load_block(words_ptr, codes_ptr, fcell_ptr, fat_ptr, nrow, jj, m, n_ok, cells,
                                            gl.minimum(k0 + 256, Kp - 256), Kp, EVEN)
        else:
            La, Lb, Cw, H = _load_block(words_ptr, codes_ptr, fcell_ptr, fat_ptr, nrow, jj, m, n_ok, cells, k0, Kp,
                                        EVEN)
        ws = _decode(La, Lb, Cw, H, b2)
        for e in gl.static_range(8):
            kk = k0 + 32 * e + ka
            if EVEN:
                a = gl.load(x_ptr + xrow + gl.expand_dims(kk, 0), mask=r_ok & gl.expand_dims(ka < 32, 0), other=0.0)
            else:
                a = gl.load(x_ptr + xrow + gl.expand_dims(kk, 0), mask=r_ok & gl.expand_dims(kk < K, 0), other=0.0)
            acc = mma_v2(a, ws[e], acc)
        if PREFETCH:
            La, Lb, Cw, H = nLa, nLb, nCw, nH
    ro = pid_m * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    co = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(y_ptr + gl.expand_dims(ro.to(gl.int64) * N, 1) + gl.expand_dims(co, 0), acc,
             mask=gl.expand_dims(ro < T, 1) & gl.expand_dims(co < N, 0))


def w12_gemv(x: torch.Tensor, lay, out: torch.Tensor, block_n: int = 64, warps: int | None = None,
             prefetch: bool = False) -> torch.Tensor:
    """y fp32 [T, N] = x [T, K] bf16 @ W^T for an OctLayout W (no checks beyond shapes: an experiment). One warp a
    MMA column tile of 8 up to 4 warps (block_n 16: 2 warps; more programs where N is small, no split-K here)."""
    warps = warps or min(4, block_n // 8)
    T, K = x.shape
    N = lay.shape[0]
    assert lay.shape[1] == K and out.shape == (T, N) and x.dtype == torch.bfloat16
    fat = lay.fat if lay.fat.numel() else lay.words
    grid = (-(-N // block_n), -(-T // TILE_M))
    _w12_gemv_kernel[grid](x, lay.words, lay.codes, lay.base, lay.fat_cells, fat, out, T, N, K, lay.padded_cols,
                           BLOCK_N=block_n, WARPS=warps, PREFETCH=prefetch, EVEN=N % block_n == 0 and K % 256 == 0,
                           num_warps=warps)
    return out


def compile_only(block_n: int = 64, warps: int | None = None, prefetch: bool = False) -> dict[str, int]:
    """sm_90 SASS opcode counts of the kernel, cross-compiled here (Triton ships ptxas), and its registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from specpilot.kernels.sass import ptxas_sass, sass_opcodes

    warps = warps or min(4, block_n // 8)
    fn = _w12_gemv_kernel
    sig = {"x_ptr": "*bf16", "words_ptr": "*i32", "codes_ptr": "*i32", "base_ptr": "*i32", "fcell_ptr": "*i32",
           "fat_ptr": "*i32", "y_ptr": "*fp32", "T": "i32", "N": "i32", "K": "i32", "Kp": "i32",
           "BLOCK_N": "constexpr", "WARPS": "constexpr", "PREFETCH": "constexpr", "EVEN": "constexpr"}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    consts = {"BLOCK_N": block_n, "WARPS": warps, "PREFETCH": prefetch, "EVEN": True}
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    log, sass = ptxas_sass(k.asm["ptx"])
    regs = re.findall(r"Used (\d+) registers", log)
    ops = sass_opcodes(sass)
    return {"registers": int(regs[0]) if regs else -1, **dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,128256x4096")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--prefetch", default="0,1", help="1: the next block's words loaded by hand a block ahead")
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args()
    if a.compile_only:
        for bn, pf in itertools.product(map(int, a.block_n.split(",")), map(int, a.prefetch.split(","))):
            print(f"block_n {bn} prefetch {pf}:", json.dumps(compile_only(bn, prefetch=bool(pf))))
        return
    from specpilot.kernels import linear
    from specpilot.kernels.bench import l2_copies, time_graph
    from specpilot.weights.format import encode
    from specpilot.weights.oct import decode_oct, oct_layout

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        copies = l2_copies(N * K * 2, dev)
        Ws = [(torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        Qs = [oct_layout(encode(W)) for W in Ws]
        for T in map(int, a.tokens.split(",")):
            x = torch.randn(T, K, generator=g, device=dev).to(torch.bfloat16)
            y = torch.empty(T, N, device=dev)
            ref = linear(x, decode_oct(Qs[0]), out_dtype=torch.float32)
            bf16_us = time_graph([lambda W=W: linear(x, W) for W in Ws], 15) * 1e3
            pkg_us = time_graph([lambda Q=Q: linear(x, Q) for Q in Qs], 15) * 1e3
            for bn, pf in itertools.product(map(int, a.block_n.split(",")), map(int, a.prefetch.split(","))):
                run = lambda Q, bn=bn, pf=pf: w12_gemv(x, Q, y, bn, prefetch=bool(pf))  # noqa: E731
                same = torch.equal(run(Qs[0]).view(torch.int32), ref.view(torch.int32))
                us = time_graph([lambda Q=Q: run(Q) for Q in Qs], 15) * 1e3
                row = {"shape": shape, "T": T, "block_n": bn, "prefetch": pf, "gluon_us": us,
                       "package_w12_us": pkg_us, "bf16_us": bf16_us, "bits_equal": same}
                rows.append(row)
                print(f"{shape:>11} T={T:<3} bn={bn:<3} pf={pf} gluon {us:7.1f} us  package W12 {pkg_us:7.1f}  bf16 "
                      f"{bf16_us:7.1f}  gluon x bf16 {bf16_us / us:.2f}  bits {'equal' if same else 'DIFFER'}",
                      flush=True)
        del Ws, Qs
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
