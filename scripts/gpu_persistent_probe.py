"""Issue #4's structural question, measured before building it: does a grid barrier inside one persistent kernel
cost less than a kernel boundary in a captured step?

A stand-in for the decode step's projections (no attention, no norms): per layer four GEMVs in a chain, at a model's
shapes (qkv [Q, H], o [H, H'], gate_up [2I, H], down [H, I]; each reads the previous one's output), one token, bf16
weights, fp32 sums. The same tile code runs as
  sep      one launch per GEMV (4 a layer), plain stream order;
  sep_pdl  the same with programmatic dependent launch (each program loads its W tile, then waits);
  layer    one persistent launch per layer: the four GEMVs as phases behind grid barriers, each program loading its
           next phase's W tile before it spins;
  whole    one persistent launch for every layer;
  *_ld     the same, polling the barrier with volatile loads from every thread (then one acquire fence).
The persistent grid is the SM count (every program resident, or a barrier never opens). Each variant is captured in
a CUDA graph and timed per replay; all must agree bit for bit (the same tiles, the same sums). Prints a table of us
per GEMV and the weight-read floor.

python3 scripts/gpu_persistent_probe.py OUT.json [--shape smollm2] [--layers N] [--reps R]
TRITON_INTERPRET=1 python3 scripts/gpu_persistent_probe.py - --shape tiny --cpu   (one program: barriers pass)
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from specpilot.kernels.bench import time_graph  # (importing specpilot.kernels fixes the interpreter: --cpu)

CHUNK = 128
# (hidden, qkv rows, o_proj inputs, intermediate). Whole W tiles live in registers: small shapes only.
SHAPES = {"smollm2": (576, 960, 576, 1536), "tiny": (64, 96, 64, 128)}


@triton.jit
def _load_w(w_ptr, row0, N, K, BN: tl.constexpr, CHUNKS: tl.constexpr):
    rows = row0 + tl.arange(0, BN)
    ks = tl.arange(0, 128)
    tiles = ()
    for c in tl.static_range(CHUNKS):
        kk = c * 128 + ks
        tiles = tiles + (tl.load(w_ptr + rows[:, None] * K + kk[None, :],
                                 mask=(rows < N)[:, None] & (kk < K)[None, :], other=0.0),)
    return tiles


@triton.jit
def _gemv(tiles, x_ptr, y_ptr, row0, N, K, BN: tl.constexpr, CHUNKS: tl.constexpr, CG: tl.constexpr):
    rows = row0 + tl.arange(0, BN)
    ks = tl.arange(0, 128)
    acc = tl.zeros([BN], tl.float32)
    for c in tl.static_range(CHUNKS):
        kk = c * 128 + ks
        if CG:  # written by other programs of this launch: from L2, never a stale L1 line
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0, cache_modifier=".cg")
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
        acc += tl.sum(tiles[c].to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _arrive(cnt_ptr, idx):
    tl.debug_barrier()  # every thread's stores precede the arrival
    tl.atomic_add(cnt_ptr + idx, 1, sem="release", scope="gpu")


@triton.jit
def _wait(cnt_ptr, idx, target, SPIN: tl.constexpr):
    """SPIN 0: one thread polls with acquire atomics (each poll a shared-memory broadcast and a CTA barrier);
    1: every thread polls with volatile loads (L2, no CTA barrier a poll), then one acquire fence."""
    if SPIN == 0:
        seen = tl.atomic_add(cnt_ptr + idx, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(cnt_ptr + idx, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.load(cnt_ptr + idx, volatile=True)
        while seen < target:
            seen = tl.load(cnt_ptr + idx, volatile=True)
        # the acquire half of the arrivals' release: the polls were relaxed
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [tl.full([1], 0, tl.int32) + seen],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _phase_kernel(w_ptr, x_ptr, y_ptr, N, K, BN: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    row0 = tl.program_id(0) * BN
    tiles = _load_w(w_ptr, row0, N, K, BN, CHUNKS)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _gemv(tiles, x_ptr, y_ptr, row0, N, K, BN, CHUNKS, False)


@triton.jit
def _persistent_kernel(wq, wo, wg, wd, b0, b1, b2, cnt, L0, L1, H, Q, HO, G, I, SQ, SO, SG, SD, NPROG: tl.constexpr,
                       BQ: tl.constexpr, BO: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
                       CH_H: tl.constexpr, CH_HO: tl.constexpr, CH_I: tl.constexpr,
                       SPIN: tl.constexpr):
    pid = tl.program_id(0)  # SQ..SD: a layer's elements in each stacked weight (int64 when large)
    for layer in tl.range(L0, L1):
        i = layer * 4
        t = _load_w(wq + layer * SQ, pid * BQ, Q, H, BQ, CH_H)  # before the wait: streams through the barrier
        if layer > L0:
            _wait(cnt, i - 1, NPROG, SPIN)
        _gemv(t, b0, b1, pid * BQ, Q, H, BQ, CH_H, True)
        _arrive(cnt, i)
        t = _load_w(wo + layer * SO, pid * BO, H, HO, BO, CH_HO)
        _wait(cnt, i, NPROG, SPIN)
        _gemv(t, b1, b0, pid * BO, H, HO, BO, CH_HO, True)
        _arrive(cnt, i + 1)
        t = _load_w(wg + layer * SG, pid * BG, G, H, BG, CH_H)
        _wait(cnt, i + 1, NPROG, SPIN)
        _gemv(t, b0, b2, pid * BG, G, H, BG, CH_H, True)
        _arrive(cnt, i + 2)
        t = _load_w(wd + layer * SD, pid * BD, H, I, BD, CH_I)
        _wait(cnt, i + 2, NPROG, SPIN)
        _gemv(t, b2, b0, pid * BD, H, I, BD, CH_I, True)
        _arrive(cnt, i + 3)


def block_rows(n: int, programs: int) -> int:
    return triton.next_power_of_2(triton.cdiv(n, programs))


class Chain:
    """Weights of `layers` layers and the activation buffers of the GEMV chain."""

    def __init__(self, shape: str, layers: int, device, programs: int):
        H, Q, HO, I = SHAPES[shape]
        self.H, self.Q, self.HO, self.G, self.I, self.L = H, Q, HO, 2 * I, I, layers
        g = torch.Generator(device=device).manual_seed(0)

        def w(n, k):
            return (torch.randn(layers, n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)
        self.wq, self.wo, self.wg, self.wd = w(Q, H), w(H, HO), w(2 * I, H), w(H, I)
        self.x0 = torch.randn(H, generator=g, device=device).to(torch.bfloat16)
        self.b0 = torch.empty(H, dtype=torch.bfloat16, device=device)
        self.b1 = torch.empty(Q, dtype=torch.bfloat16, device=device)
        self.b2 = torch.empty(2 * I, dtype=torch.bfloat16, device=device)
        self.cnt = torch.zeros(layers * 4, dtype=torch.int32, device=device)
        self.programs = programs
        self.bn = {name: block_rows(n, programs) for name, n in (("q", Q), ("o", H), ("g", 2 * I), ("d", H))}

    def weight_bytes(self) -> int:
        return sum(t.numel() * 2 for t in (self.wq, self.wo, self.wg, self.wd))

    def phases(self, layer: int):
        """(w, x, y, N, K, BN) of the layer's four GEMVs."""
        return ((self.wq[layer], self.b0, self.b1, self.Q, self.H, self.bn["q"]),
                (self.wo[layer], self.b1, self.b0, self.H, self.HO, self.bn["o"]),
                (self.wg[layer], self.b0, self.b2, self.G, self.H, self.bn["g"]),
                (self.wd[layer], self.b2, self.b0, self.H, self.I, self.bn["d"]))

    def run_separate(self, pdl: bool):
        self.b0.copy_(self.x0)
        for layer in range(self.L):
            for w, x, y, n, k, bn in self.phases(layer):
                kw = {"launch_pdl": True} if pdl else {}
                _phase_kernel[(triton.cdiv(n, bn),)](w, x, y, n, k, BN=bn, CHUNKS=triton.cdiv(k, CHUNK),
                                                     PDL=pdl, num_warps=4, **kw)

    def run_persistent(self, per_layer: bool, spin: int = 0):
        self.b0.copy_(self.x0)
        self.cnt.zero_()
        spans = [(i, i + 1) for i in range(self.L)] if per_layer else [(0, self.L)]
        for l0, l1 in spans:
            _persistent_kernel[(self.programs,)](
                self.wq, self.wo, self.wg, self.wd, self.b0, self.b1, self.b2, self.cnt, l0, l1, self.H, self.Q,
                self.HO, self.G, self.I, *(w[0].numel() for w in (self.wq, self.wo, self.wg, self.wd)),
                NPROG=self.programs, BQ=self.bn["q"], BO=self.bn["o"], BG=self.bn["g"],
                BD=self.bn["d"], CH_H=triton.cdiv(self.H, CHUNK), CH_HO=triton.cdiv(self.HO, CHUNK),
                CH_I=triton.cdiv(self.I, CHUNK), SPIN=spin, num_warps=4)

    def reference(self) -> torch.Tensor:
        """The chain in torch (fp32 sums of bf16 products, rounded to bf16 after each GEMV): close, not bitwise."""
        x = self.x0
        for layer in range(self.L):
            for w, _, _, n, k, _ in self.phases(layer):
                x = (w.float() @ x[:k].float()).to(torch.bfloat16)
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--programs", default="", help="persistent grid sizes, comma-separated (default: SM count)")
    ap.add_argument("--cpu", action="store_true", help="interpreter check: one program, no timing")
    a = ap.parse_args()
    if a.cpu:
        ch = Chain(a.shape, a.layers, "cpu", 1)
        outs = {}
        for name, fn in (("sep", lambda: ch.run_separate(False)), ("layer", lambda: ch.run_persistent(True)),
                         ("whole", lambda: ch.run_persistent(False))):
            fn()
            outs[name] = ch.b0.clone()
        ref = ch.reference()
        ok = all(torch.equal(outs["sep"], v) for v in outs.values())
        err = (outs["sep"].float() - ref.float()).abs().max().item()
        print(f"cpu: variants equal bitwise: {ok}; max |sep - torch| {err:.3g}")
        sys.exit(0 if ok and err < 0.05 else 1)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for programs in [int(p) for p in a.programs.split(",") if p] or [sms]:
        ch = Chain(a.shape, a.layers, dev, programs)
        gemvs = 4 * a.layers
        floor_us = ch.weight_bytes() / 4.2e12 * 1e6 / gemvs
        outs = {}
        for name, fn in (("sep", lambda: ch.run_separate(False)), ("sep_pdl", lambda: ch.run_separate(True)),
                         ("layer", lambda: ch.run_persistent(True)), ("whole", lambda: ch.run_persistent(False)),
                         ("layer_ld", lambda: ch.run_persistent(True, 1)),
                         ("whole_ld", lambda: ch.run_persistent(False, 1))):
            ms = time_graph([fn], a.reps)
            outs[name] = ch.b0.clone()
            rows.append({"programs": programs, "variant": name, "ms": ms, "us_per_gemv": ms * 1e3 / gemvs,
                         "floor_us_per_gemv": floor_us, "equal_sep": bool(torch.equal(outs[name], outs["sep"]))})
        err = (outs["sep"].float() - ch.reference().float()).abs().max().item()
        rows.append({"programs": programs, "variant": "torch_err", "ms": err})
    if a.out != "-":
        json.dump({"shape": a.shape, "layers": a.layers, "rows": rows}, open(a.out, "w"), indent=1)
    print(f"| {a.shape} x{a.layers} | programs | ms a step | us a GEMV | floor us | = sep |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["variant"] == "torch_err":
            print(f"| max err vs torch | {r['programs']} | {r['ms']:.3g} | | | |")
        else:
            print(f"| {r['variant']} | {r['programs']} | {r['ms']:.4f} | {r['us_per_gemv']:.2f} | "
                  f"{r['floor_us_per_gemv']:.2f} | {r['equal_sep']} |")


if __name__ == "__main__":
    main()
