"""GPU: the package's W12 `linear` and bf16 `linear` over the same launch parameters (block_n x num_stages x split_k
x num_warps), T=1 and 16, best against best (and bf16 at its defaults): which launch shape suits the oct decode, and
the issue #6 ratio (notes/h200.md, sessions 28-29).

python3 scripts/gpu_w12_params.py OUT.json [--shapes 4096x4096,14336x4096] [--op linear|norm|glu] [--budget-s 200]
(--op norm: rmsnorm_linear, glu: rmsnorm_glu with W [2I, K] = gate|up, as the engine's QKV / gate_up launches)
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from specpilot.kernels import linear, rmsnorm_linear
from specpilot.kernels.norm_epilogues import rmsnorm_glu
from specpilot.kernels.bench import l2_copies, time_graph
from specpilot.weights.format import encode
from specpilot.weights.oct import oct_layout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--op", choices=("linear", "norm", "glu"), default="linear")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--warps", default="4", help="num_warps values (8: half the registers a thread, session 30)")
    ap.add_argument("--maxnreg", default="0", help="the launches' max_registers (ptxas maxnreg; 0: none), e.g. "
                                                  "0,168,128 (W12 at 180 registers: 2 programs an SM, session 30)")
    ap.add_argument("--budget-s", type=float, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, t0 = [], time.time()
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        copies = l2_copies(N * K * 2, dev)
        Ws = [(torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        Qs = [oct_layout(encode(W)) for W in Ws]
        for T in (int(v) for v in a.tokens.split(",")):
            x = torch.randn(T, K, generator=g, device=dev).to(torch.bfloat16)
            nw = (1 + 0.1 * torch.randn(K, generator=g, device=dev)).to(torch.bfloat16)
            op = {"linear": lambda w, **p: linear(x, w, **p),
                  "norm": lambda w, **p: rmsnorm_linear(x, nw, w, 1e-5, **p),
                  "glu": lambda w, **p: rmsnorm_glu(x, nw, w, 1e-5, **p)}[a.op]
            ref = time_graph([lambda W=W: op(W) for W in Ws], 15) * 1e3
            ref12 = time_graph([lambda Q=Q: op(Q) for Q in Qs], 15) * 1e3
            best = {}
            grid = (tuple(int(v) for v in g.split(",")) for g in (a.block_n, a.stages, a.splits, a.warps, a.maxnreg))
            for bn, stages, split, warps, regs, (fmt, ws) in itertools.product(*grid, (("bf16", Ws), ("w12", Qs))):
                if time.time() - t0 > a.budget_s:
                    break
                p = dict(block_n=bn, num_stages=stages, split_k=split, num_warps=warps, max_registers=regs or None)
                try:
                    us = time_graph([lambda w=w: op(w, **p) for w in ws], 15) * 1e3
                except Exception as e:  # noqa: BLE001 - a sweep: record and go on
                    rows.append({"shape": shape, "T": T, "format": fmt, **p, "error": str(e)[:200]})
                    continue
                row = {"op": a.op, "shape": shape, "T": T, "format": fmt, **p, "us": us,
                       "bf16_default_us": ref,
                       "w12_default_us": ref12}
                rows.append(row)
                if fmt not in best or us < best[fmt]["us"]:
                    best[fmt] = row
            if len(best) == 2:
                b, w = best["bf16"], best["w12"]
                cfg = lambda r: (f"bn={r['block_n']} stages={r['num_stages']} split={r['split_k']} "  # noqa: E731
                                 f"warps={r['num_warps']} regs={r['max_registers']}")
                print(f"{a.op:>6} {shape:>11} T={T:<3} default bf16 {ref:7.1f} W12 {ref12:7.1f} | bf16 best "
                      f"{b['us']:7.1f} us ({cfg(b)})  W12 best {w['us']:7.1f} us ({cfg(w)})  W12 x bf16 best "
                      f"{b['us'] / w['us']:.2f}", flush=True)
        del Ws, Qs
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
