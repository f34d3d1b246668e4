"""Experiment (GPU): which W12 tile decode can feed the batch-invariant dot chain at bf16 speed or better?

Standalone kernels, escape-free weights (every exponent inside a 15-wide window, code = exponent - base), so only
the decode's cost is measured. Each variant's y (fp32, [T, N]) is checked bit for bit against the package's bf16
`linear` at the same split-K. Variants (NAME_S: split-K S):
- pkg_S:   specpilot.kernels.linear on the bf16 weights (the bf16 path)
- quads_S: lo as int32 [N, K/4], word j of a 128-block = elements j, 32+j, 64+j, 96+j (bytes 0..3), codes int16
           likewise (nibbles 0..3); decoded with Triton integer ops into four 32-wide slices, four dots
- octs_S:  per 256-block two lo words (elements j, 32+j, .. 96+j and 128+j, .. 224+j) and one code word a lane
           (weights/oct.code_position); eight slices decoded by kernels/w12_tile.OCT_ASM (high nibbles 0), eight dots
- octs_Spf: the same with the next block's bytes loaded before this block's decode
Earlier variants (one byte per element with a table gather, paired 64-wide halves: 2-3x slower than these) are in
notes/h200-s13-w12-variants.json and this file's history; the session-28 escape variants over the package's oct
layout as it was then (octe, octn, oct1, oct1n: escape lists and first-escape slots) at commit 490f0dd.

python3 scripts/gpu_w12_variants.py OUT.json --variants pkg_1,pkg_4,octs_1,octs_4pf [--shapes 4096x4096,...]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
import triton.language as tl

from specpilot.kernels._common import arrival_counters
from specpilot.kernels.gemm import linear, split_k_combine
from specpilot.kernels.w12_tile import oct_decode  # the package's decode (inline PTX)
from specpilot.weights.oct import pack_nibbles

CHUNK = 128


@triton.jit
def _dec(lo, code, base):
    bits = ((lo & 0x80) << 8) | ((code + base) << 7) | (lo & 0x7F)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _program_tile(N, BLOCK_N: tl.constexpr):
    """(column tile, split-K run, token rows, W rows, W rows as int64 [1, BLOCK_N]) of this program."""
    pid = tl.program_id(0)
    tiles = (N + BLOCK_N - 1) // BLOCK_N  # not tl.cdiv: the interpreter calls it outside a kernel's scope
    cols = (pid % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid % tiles, pid // tiles, tl.arange(0, 16), cols, cols[None, :].to(tl.int64)


@triton.jit
def _quad_split_kernel(x_ptr, l_ptr, c_ptr, y_ptr, ws_ptr, cnt_ptr, T, N, K, K_SPLIT, base, BLOCK_N: tl.constexpr,
                       SPLIT_K: tl.constexpr):
    tile, pid_k, rows, cols, c64 = _program_tile(N, BLOCK_N)
    K4 = K // 4
    j = tl.arange(0, 32)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, (pid_k + 1) * K_SPLIT, 128):
        L = tl.load(l_ptr + c64 * K4 + k0 // 4 + j[:, None])
        Ci = tl.load(c_ptr + c64 * K4 + k0 // 4 + j[:, None]).to(tl.int32)
        for q in tl.static_range(4):
            xq = tl.load(x_ptr + rows[:, None] * K + k0 + 32 * q + j[None, :], mask=rows[:, None] < T, other=0.0)
            w = _dec((L >> (8 * q)) & 0xFF, (Ci >> (4 * q)) & 15, base)
            acc = tl.dot(xq, w, acc)
    acc, _, last = split_k_combine(acc, acc, ws_ptr, cnt_ptr, tile, pid_k, SPLIT_K, False, 16, BLOCK_N)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < T) & last)


@triton.jit
def _oct_split_kernel(x_ptr, l_ptr, c_ptr, y_ptr, ws_ptr, cnt_ptr, T, N, K, K_SPLIT, base, BLOCK_N: tl.constexpr,
                      SPLIT_K: tl.constexpr,
                      PF: tl.constexpr = False):
    tile, pid_k, rows, cols, c64 = _program_tile(N, BLOCK_N)
    K4 = K // 4
    K8 = K // 8
    j = tl.arange(0, 32)
    b2 = tl.zeros([32, BLOCK_N], dtype=tl.int32) + ((base << 7) | (base << 23))
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    k_first = pid_k * K_SPLIT
    k_last = (pid_k + 1) * K_SPLIT - 256
    La = tl.load(l_ptr + c64 * K4 + k_first // 4 + j[:, None])
    Lb = tl.load(l_ptr + c64 * K4 + k_first // 4 + 32 + j[:, None])
    Cw = tl.load(c_ptr + c64 * K8 + k_first // 8 + j[:, None])
    for k0 in range(k_first, k_last + 256, 256):
        if PF:  # the next block's bytes are in flight while this one is decoded and multiplied
            nk = tl.minimum(k0 + 256, k_last)
            nLa = tl.load(l_ptr + c64 * K4 + nk // 4 + j[:, None])
            nLb = tl.load(l_ptr + c64 * K4 + nk // 4 + 32 + j[:, None])
            nCw = tl.load(c_ptr + c64 * K8 + nk // 8 + j[:, None])
        else:
            La = tl.load(l_ptr + c64 * K4 + k0 // 4 + j[:, None])
            Lb = tl.load(l_ptr + c64 * K4 + k0 // 4 + 32 + j[:, None])
            Cw = tl.load(c_ptr + c64 * K8 + k0 // 8 + j[:, None])
        ws = oct_decode(La, Lb, Cw, tl.zeros_like(b2), b2)  # escape-free: no high nibbles
        for e in tl.static_range(8):
            xq = tl.load(x_ptr + rows[:, None] * K + k0 + 32 * e + j[None, :], mask=rows[:, None] < T, other=0.0)
            acc = tl.dot(xq, ws[e], acc)
        if PF:
            La = nLa
            Lb = nLb
            Cw = nCw
    acc, _, last = split_k_combine(acc, acc, ws_ptr, cnt_ptr, tile, pid_k, SPLIT_K, False, 16, BLOCK_N)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < T) & last)


def escape_free(N: int, K: int, g: torch.Generator, dev) -> tuple[torch.Tensor, int, torch.Tensor]:
    """bf16 W [N, K] ~ 0.02 randn with every exponent clamped into the 15-wide window ending at the largest."""
    w = (torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    e = (w >> 7) & 0xFF
    top = int(e.max())
    base = top - 14
    e = e.clamp(base, top)
    bits = (w & 0x807F) | (e << 7)
    W = bits.to(torch.int16).view(torch.bfloat16)
    return W, base, (e - base).to(torch.uint8)


def layouts(W: torch.Tensor, codes: torch.Tensor) -> dict[str, torch.Tensor]:
    N, K = W.shape
    b = W.view(torch.int16).to(torch.int32)
    lo = (((b >> 8) & 0x80) | (b & 0x7F)).to(torch.int32)
    c = codes.to(torch.int32)
    lb = lo.view(N, K // CHUNK, 4, 32)
    quad_l = (lb[:, :, 0] | (lb[:, :, 1] << 8) | (lb[:, :, 2] << 16) | (lb[:, :, 3] << 24)).reshape(N, K // 4)
    cq = c.view(N, K // CHUNK, 4, 32)
    quad_c = (cq[:, :, 0] | (cq[:, :, 1] << 4) | (cq[:, :, 2] << 8) | (cq[:, :, 3] << 12)).reshape(N, K // 4)
    ob = lo.view(N, K // 256, 2, 4, 32)
    oct_l = (ob[:, :, :, 0] | (ob[:, :, :, 1] << 8) | (ob[:, :, :, 2] << 16) | (ob[:, :, :, 3] << 24))
    oct_l = oct_l.reshape(N, K // 4)
    oct_c = pack_nibbles(c.view(N, K // 256, 8, 32)).reshape(N, K // 8)  # the package's code positions
    return {"oct_l": oct_l.contiguous(), "oct_c": oct_c.to(torch.int32).contiguous(), "quad_l": quad_l.contiguous(),
            "quad_c": quad_c.to(torch.int16).contiguous()}


def launcher(variant: str, x, W, lay, y, base, bn, warps, stages):
    """A call of `variant` (NAME_S[pf], see the module doc) writing y fp32 [T, N]."""
    T, K = x.shape
    N = W.shape[0]
    name, tail = variant.split("_")
    split = int(tail.removesuffix("pf"))
    if name == "pkg":
        return lambda: linear(x, W, out_dtype=torch.float32, out=y, block_n=bn, num_warps=warps, num_stages=stages,
                              split_k=split)
    grid = (triton.cdiv(N, bn) * split,)
    ws = torch.empty(grid[0] * 16 * bn, dtype=torch.float32, device=x.device)
    args = (y, ws, arrival_counters(x.device), T, N, K, K // split, base)
    kw = dict(BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages)
    if name == "octs":
        return lambda: _oct_split_kernel[grid](x, lay["oct_l"], lay["oct_c"], *args,
                                               PF=tail.endswith("pf"), **kw)
    if name == "quads":
        return lambda: _quad_split_kernel[grid](x, lay["quad_l"], lay["quad_c"], *args, **kw)
    raise ValueError(f"unknown variant {variant!r}")


def main() -> None:
    from specpilot.kernels.bench import l2_copies, time_graph

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="4096x4096,14336x4096")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--variants", default="pkg_1,pkg_4,quads_4,octs_1,octs_1pf,octs_4pf")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=400)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, t0 = [], time.time()
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        copies = l2_copies(N * K * 2, dev)
        data = []
        for _ in range(copies):
            W, base, codes = escape_free(N, K, g, dev)
            lay = layouts(W, codes)
            data.append((W, base, lay))
        for T in (int(v) for v in a.tokens.split(",")):
            x = torch.randn(T, K, generator=g, device=dev).to(torch.bfloat16)
            for variant in a.variants.split(","):
                best = None
                ref = torch.empty(T, N, device=dev)  # the same reduction order: split-K partials change it
                split = variant.split("_")[1].removesuffix("pf")
                launcher(f"pkg_{split}", x, data[0][0], None, ref, 0, 32, 4, 3)()
                for bn, warps, stages in itertools.product(*(map(int, s.split(",")) for s in
                                                            (a.block_n, a.warps, a.stages))):
                    if time.time() - t0 > a.budget_s:
                        break
                    y = torch.empty(T, N, device=dev)
                    try:
                        launcher(variant, x, data[0][0], data[0][2], y, data[0][1], bn, warps, stages)()
                        torch.cuda.synchronize()
                        equal = bool(torch.equal(y.view(torch.int32), ref.view(torch.int32)))
                        ys = [torch.empty(T, N, device=dev) for _ in data]
                        fns = [launcher(variant, x, W, lay, yy, base, bn, warps, stages)
                               for (W, base, lay), yy in zip(data, ys)]
                        us = time_graph(fns, a.reps) * 1e3
                    except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                        rows.append({"shape": shape, "T": T, "variant": variant, "bn": bn, "warps": warps,
                                     "stages": stages, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                        continue
                    row = {"shape": shape, "T": T, "variant": variant, "bn": bn, "warps": warps, "stages": stages,
                           "us": us, "equal": equal}
                    rows.append(row)
                    if best is None or us < best["us"]:
                        best = row
                if best:
                    print(f"{shape:>11} T={T:<3} {variant:>8} best {best['us']:8.1f} us  bn={best['bn']} "
                          f"warps={best['warps']} stages={best['stages']} equal={best['equal']}", flush=True)
        del data
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
