"""Launch-parameter sweep of the projection kernels at one model's shapes, timed inside CUDA graphs (a Python
launch costs more than these kernels run, so timing outside a graph measures the launcher).

python3 scripts/gpu_gemv_sweep.py OUT.json [--shape smollm2|llama8b] [--tokens 1,16]

For each projection (qkv, o, gate_up, down, head) and T: the default launch's time and the best of the grid
block_k x block_n x num_warps x num_stages; block_k is a reduction-order field, so the best block_k is chosen
on the sum over T and the rest per T. Prints a table last.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels import linear, rmsnorm_linear, swiglu_linear
from specpilot.kernels.bench import time_graph

SHAPES = {"smollm2": SMOLLM2_135M, "llama8b": LLAMA3_8B}


def graph_us(fn, launches: int = 20, reps: int = 30) -> float:
    return time_graph([fn] * launches, reps) * 1e3


def kernels(sh, T: int, dev):
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, scale=0.02):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(torch.bfloat16)
    H, I, V = sh.hidden, sh.intermediate, sh.vocab
    qkv_n = (sh.heads + 2 * sh.kv_heads) * sh.head_dim
    x, nw, r = rnd(T, H, scale=1.0), rnd(H, scale=1.0), rnd(T, H, scale=1.0)
    a, gu = rnd(T, sh.heads * sh.head_dim, scale=1.0), rnd(T, 2 * I, scale=1.0)
    w = {"qkv": rnd(qkv_n, H), "o": rnd(H, sh.heads * sh.head_dim), "gate_up": rnd(2 * I, H), "down": rnd(H, I),
         "head": rnd(V, H)}
    return {
        "qkv": lambda **p: rmsnorm_linear(x, nw, w["qkv"], 1e-5, **p),
        "o": lambda **p: linear(a, w["o"], r, **p),
        "gate_up": lambda **p: rmsnorm_linear(x, nw, w["gate_up"], 1e-5, **p),
        "down": lambda **p: swiglu_linear(gu, w["down"], r, **p),
        "head": lambda **p: rmsnorm_linear(x, nw, w["head"], 1e-5, out_dtype=torch.float32, argmax=True,
                                           store_y=False, **p),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--block-k", default="128,256,512,1024")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,3")
    a = ap.parse_args()
    sh, dev = SHAPES[a.shape], torch.device("cuda")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    tokens = ints(a.tokens)
    grid = list(itertools.product(ints(a.block_k), ints(a.block_n), ints(a.warps), ints(a.stages)))
    res = {}
    for name in ("qkv", "o", "gate_up", "down", "head"):
        per_t = {}
        for T in tokens:
            fn = kernels(sh, T, dev)[name]
            rows = {"default": graph_us(lambda: fn())}
            for bk, bn, nw, st in grid:
                try:
                    rows[f"{bk},{bn},{nw},{st}"] = graph_us(lambda: fn(block_k=bk, block_n=bn, num_warps=nw,
                                                                       num_stages=st))
                except Exception:  # out of shared memory / registers for this tile: not a candidate
                    rows[f"{bk},{bn},{nw},{st}"] = float("inf")
            per_t[T] = rows
        # block_k fixes the reduction order: one per shape, chosen on the sum over T of each T's best
        best_bk = min(ints(a.block_k), key=lambda bk: sum(min(v for k, v in per_t[T].items()
                                                                if k != "default" and int(k.split(",")[0]) == bk)
                                                            for T in tokens))
        res[name] = {"block_k": best_bk, "per_t": {}}
        for T in tokens:
            cands = {k: v for k, v in per_t[T].items() if k != "default" and int(k.split(",")[0]) == best_bk}
            k_best = min(cands, key=cands.get)
            res[name]["per_t"][T] = {"default_us": per_t[T]["default"], "best_us": cands[k_best], "best": k_best,
                                     "best_any_us": min(v for k, v in per_t[T].items() if k != "default")}
        json.dump({"shape": a.shape, "results": res, "raw": {n: None for n in res}}, open(a.out, "w"), indent=1)
        print(name, res[name], flush=True)
    print("| kernel | T | default us | tuned us | block_k,block_n,warps,stages |\n|---|---|---|---|---|")
    for name, r in res.items():
        for T, v in r["per_t"].items():
            print(f"| {name} | {T} | {v['default_us']:.2f} | {v['best_us']:.2f} | {v['best']} |")


if __name__ == "__main__":
    main()
