"""Before folding the attention combine into o_proj (notes/h200.md, session 27's plan): what a combine costs whose
numerics follow no tile layout, against today's.

Today's combine (kernels/attn.combine_splits) loads a row's split partials as one [GROUP, D] tile and sums them
with tl.sum, whose tree follows the tile's layout: a kernel that computed the combine inside another tile shape
(o_proj's prologue) would round differently. The candidate numerics: per (row, d) a sequential fma over the splits
in ascending order, after their max (exact in any order), so any kernel that runs the same statements gets the same
bits whatever its layout. Variants, each timed as 30 launches in one CUDA graph (a step's layers):
  today     _attn_combine_kernel, one program a row;
  seq_row   sequential, one program a row ([D] vectors), the splits in a runtime loop;
  seq_tok   sequential, one program a token ([H, D] tile: every head at once);
  seq_g8    seq_tok with the splits' loads issued 8 at a time (a static group), then the 8 fmas in order;
  seq_row_g8  seq_row so grouped;
  seq_row_ns4  seq_row's loop as tl.range(num_stages=4) (triton's software pipelining);
  seq_row_ahead  seq_row with each split's loads issued one split ahead by hand.
Every seq_* variant takes the splits' max from [rows, 64] tiles (a max is exact in any order).
The seq_* variants must agree bit for bit (same statements per element); today's is compared with a tolerance.

python3 scripts/gpu_combine_probe.py OUT.json [--contexts 128,512,2048] [--tokens 1,16]
TRITON_INTERPRET=1 python3 scripts/gpu_combine_probe.py - --cpu
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from specpilot.kernels._common import NO_FP_FUSION
from specpilot.kernels.attn import SPLIT_GROUP, _attn_combine_kernel
from specpilot.kernels.bench import time_graph

SHAPES = {"smollm2": (9, 64), "llama8b": (32, 128), "tiny": (3, 16)}  # (query heads, head dim)
SPLIT = 64  # keys a split (the engine's default split_keys)


@triton.jit
def _top(m_ptr, rows, stride, n_split, ok, MAXG: tl.constexpr):
    """The rows' max over their splits (n_split <= MAXG) from one tile load: a max is exact in any order. (A loop
    of such maxima failed triton 3.6's TritonGPUOptimizeThreadLocality pass on the H200.)"""
    sp = tl.arange(0, MAXG)
    m = tl.load(m_ptr + sp[None, :] * stride + rows[:, None], mask=ok[:, None] & (sp < n_split)[None, :],
                other=float("-inf"))
    top = tl.max(m, axis=1)
    return tl.where(top > float("-inf"), top, 0.0)


@triton.jit
def _load_split(m_ptr, l_ptr, o_ptr, sp, rows, dd, stride, ok, D: tl.constexpr):
    m = tl.load(m_ptr + sp * stride + rows, mask=ok, other=float("-inf"))
    lv = tl.load(l_ptr + sp * stride + rows, mask=ok, other=0.0)
    o = tl.load(o_ptr + (sp * stride + rows)[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
    return m, lv, o


@triton.jit
def _fold(m, lv, o, top, acc, lsum):
    """One split into the sums, per element: the same statements whatever the layout (m = -inf: exact no-op)."""
    use = m > float("-inf")
    scale = tl.where(use, tl.exp2(m - top), 0.0)
    lsum = tl.fma(scale, tl.where(use, lv, 0.0), lsum)
    acc = tl.fma(scale[:, None], tl.where(use[:, None], o, 0.0), acc)
    return acc, lsum


@triton.jit
def _seq_kernel(m_ptr, l_ptr, o_ptr, out_ptr, stride, n_split, R: tl.constexpr, RP: tl.constexpr,
                D: tl.constexpr, LOOP: tl.constexpr, GROUP: tl.constexpr):
    """R rows a program (RP: R rounded up to a power of two). LOOP 0: a plain loop over the splits; 1: their loads
    issued GROUP at a time; 2: tl.range with num_stages=GROUP (triton's pipelining); 3: each split's loads issued
    one split ahead by hand (registers carry the next split)."""
    rows = tl.program_id(0) * R + tl.arange(0, RP)
    ok = tl.arange(0, RP) < R
    dd = tl.arange(0, D)
    top = _top(m_ptr, rows, stride, n_split, ok, 64)
    acc = tl.zeros([RP, D], tl.float32)
    lsum = tl.zeros([RP], tl.float32)
    if LOOP == 0:
        for sp in range(0, n_split):
            m, lv, o = _load_split(m_ptr, l_ptr, o_ptr, sp, rows, dd, stride, ok, D)
            acc, lsum = _fold(m, lv, o, top, acc, lsum)
    elif LOOP == 1:
        for g0 in range(0, n_split, GROUP):
            for j in tl.static_range(GROUP):  # past n_split: m = -inf, an exact no-op
                m, lv, o = _load_split(m_ptr, l_ptr, o_ptr, g0 + j, rows, dd, stride, ok & (g0 + j < n_split), D)
                acc, lsum = _fold(m, lv, o, top, acc, lsum)
    elif LOOP == 2:
        for sp in tl.range(0, n_split, num_stages=GROUP):
            m, lv, o = _load_split(m_ptr, l_ptr, o_ptr, sp, rows, dd, stride, ok, D)
            acc, lsum = _fold(m, lv, o, top, acc, lsum)
    else:
        m, lv, o = _load_split(m_ptr, l_ptr, o_ptr, 0, rows, dd, stride, ok, D)
        for sp in range(0, n_split):
            m2, lv2, o2 = _load_split(m_ptr, l_ptr, o_ptr, sp + 1, rows, dd, stride, ok & (sp + 1 < n_split), D)
            acc, lsum = _fold(m, lv, o, top, acc, lsum)
            m, lv, o = m2, lv2, o2
    out = acc / lsum[:, None]
    tl.store(out_ptr + rows[:, None] * D + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def partials(T: int, H: int, D: int, n_split: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    R = T * H
    m = torch.randn(n_split, R, generator=g, device=device) * 3
    m[-1, ::5] = float("-inf")  # a split without a visible key for some rows
    l = torch.rand(n_split, R, generator=g, device=device) * 64 + 1
    o = torch.randn(n_split, R, D, generator=g, device=device) * 8
    return m.contiguous(), l.contiguous(), o.contiguous()


def combine_ref(m, l, o):
    top = m.max(0).values
    w = torch.exp2(m - top)
    return ((w[..., None] * o).sum(0) / (w * l).sum(0)[:, None])


def run(variant: str, m, l, o, T: int, H: int, D: int, out):
    n_split, R = m.shape
    if variant == "today":  # base + T keys: n_split splits, the last one holding the new tokens
        base = n_split * SPLIT - T
        _attn_combine_kernel[(R,)](m, l, o, out, m, T, base, n_split * SPLIT, 0, H=H, D=D, BASE_IS_PTR=False,
                                   SPLIT=SPLIT, GROUP=SPLIT_GROUP, num_warps=4, **NO_FP_FUSION)
        return
    rows, loop, group = {"seq_row": (1, 0, 1), "seq_tok": (H, 0, 1), "seq_g8": (H, 1, 8), "seq_row_g8": (1, 1, 8),
                         "seq_row_ns4": (1, 2, 4), "seq_row_ahead": (1, 3, 1)}[variant]
    _seq_kernel[(R // rows,)](m, l, o, out, R, n_split, R=rows, RP=triton.next_power_of_2(rows), D=D, LOOP=loop,
                              GROUP=group, num_warps=4, **NO_FP_FUSION)


VARIANTS = ("today", "seq_row", "seq_tok", "seq_g8", "seq_row_g8", "seq_row_ns4", "seq_row_ahead")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cpu", action="store_true", help="interpreter check of the bits, no timing")
    a = ap.parse_args()
    dev = "cpu" if a.cpu else "cuda"
    shapes = ["tiny"] if a.cpu else a.shapes.split(",")
    rows, ok = [], True
    for shape in shapes:
        H, D = SHAPES[shape]
        for ctx in [int(c) for c in a.contexts.split(",")][:1 if a.cpu else None]:
            for T in [int(t) for t in a.tokens.split(",")]:
                n_split = triton.cdiv(ctx + T, SPLIT)
                copies = [partials(T, H, D, n_split, dev, seed) for seed in range(1 if a.cpu else 30)]
                outs = {}
                for v in VARIANTS:
                    buf = [torch.empty(T * H, D, dtype=torch.bfloat16, device=dev) for _ in copies]
                    fns = [lambda c=c, b=b: run(v, *c, T, H, D, b) for c, b in zip(copies, buf)]
                    if a.cpu:
                        fns[0]()
                        us = None
                    else:
                        us = time_graph(fns, a.reps) * 1e3
                    outs[v] = buf[0].clone()
                    rows.append({"shape": shape, "context": ctx, "T": T, "splits": n_split, "variant": v, "us": us})
                ref = combine_ref(*copies[0])
                seq_equal = all(torch.equal(outs["seq_row"], outs[v]) for v in VARIANTS[2:])
                err = max((outs[v].float() - ref).abs().max().item() / ref.abs().max().item() for v in VARIANTS)
                ok = ok and seq_equal and err < 1e-2
                rows.append({"shape": shape, "context": ctx, "T": T, "seq_equal": seq_equal, "max_rel_err": err})
    if a.out != "-":
        json.dump(rows, open(a.out, "w"), indent=1)
    print("| shape | context | T | splits | " + " | ".join(f"{v} us" for v in VARIANTS)
          + " | seq bits equal | rel err |")
    print("|---" * (6 + len(VARIANTS)) + "|")
    for i in range(0, len(rows), len(VARIANTS) + 1):
        group, check = rows[i:i + len(VARIANTS)], rows[i + len(VARIANTS)]
        times = " | ".join("-" if r["us"] is None else f"{r['us']:.2f}" for r in group)
        print(f"| {group[0]['shape']} | {group[0]['context']} | {group[0]['T']} | {group[0]['splits']} | {times} | "
              f"{check['seq_equal']} | {check['max_rel_err']:.1e} |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
