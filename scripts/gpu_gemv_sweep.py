"""Launch-parameter sweep of the projection kernels at one model's shapes, timed inside CUDA graphs (a Python
launch costs more than these kernels run, so timing outside a graph measures the launcher).

python3 scripts/gpu_gemv_sweep.py OUT.json [--shape smollm2|llama8b|smollm2-drafter] [--tokens 1,16] [--kernels qkv,o]
    [--split-k 1,2] [--tile-rows 16,32]

For each projection (qkv, o, gate_up, down, head; qkv_linear, gate_up_linear: those matrices through a plain
projection; qkv_norm / qkv_norm_stat: QKV's normed projection without its epilogue, by a row pass / on producer
statistics; qkv_stat, gate_up_stat: the engine's launches on producer statistics; qkv_post, gate_up_post,
head_post: with post_scale) and T: the default launch's time and the best of the grid
block_k x block_n x num_warps x num_stages x split_k x tile_rows; block_k and split_k are reduction-order fields, so the best
(block_k, split_k) is chosen on the sum over T and the rest per T. Prints a table last, with each time's weight
read rate (weight bytes / time; the H200 reads HBM at ~4.2-4.25 TB/s). Each projection is the engine's launch:
QKV with its rotary + cache-write epilogue, gate_up with its SwiGLU epilogue, down and o_proj with the residual.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels import linear, rmsnorm_linear
from specpilot.kernels.norm_epilogues import rmsnorm_glu, rmsnorm_qkv_rope
from specpilot.kernels.bench import time_graph
from specpilot.kernels.rmsnorm import row_sumsq_ref, scaled_rows_ref

# The shipped SmolLM2 block drafter's launches (engines/drafters/block_fused.py): its 3072-wide MLP, its 8192-row
# head (drafter_head_rows), at its block of 16 rows; qkv_norm, o, gate_up, down, head_logits are its calls
SMOLLM2_DRAFTER = dataclasses.replace(SMOLLM2_135M, vocab=8192, layers=2, intermediate=3072)
SHAPES = {"smollm2": SMOLLM2_135M, "llama8b": LLAMA3_8B, "smollm2-drafter": SMOLLM2_DRAFTER}


def graph_us(fns, launches: int = 20, reps: int = 30) -> float:
    return time_graph((fns * launches)[:launches], reps) * 1e3


def kernels(sh, T: int, dev, name: str, copies: int = 1):
    """Projection `name`'s call and `copies` weight matrices for it (rotated in the timed graph, so that a matrix
    smaller than L2 is read from HBM as in a step)."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, scale=0.02):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(torch.bfloat16)
    H, I, V = sh.hidden, sh.intermediate, sh.vocab
    qkv_n = (sh.heads + 2 * sh.kv_heads) * sh.head_dim
    x, nw, r = rnd(T, H, scale=1.0), rnd(H, scale=1.0), rnd(T, H, scale=1.0)
    a, act = rnd(T, sh.heads * sh.head_dim, scale=1.0), rnd(T, I, scale=1.0)
    # the QKV launch's rotary epilogue writes k and v to a cache at slots 0..T-1
    D, S = sh.head_dim, 256
    pos, slots = torch.arange(T, device=dev), torch.arange(T, device=dev)
    cos, sin = (torch.rand(S, D // 2, generator=g, device=dev) for _ in range(2))
    kc, vc = (torch.zeros(sh.kv_heads, S, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
    shapes = {"qkv": (qkv_n, H), "o": (H, sh.heads * sh.head_dim), "gate_up": (2 * I, H), "down": (H, I),
              "head": (V, H), "head_logits": (V, H)}
    shapes.update(qkv_linear=shapes["qkv"], gate_up_linear=shapes["gate_up"], qkv_norm=shapes["qkv"],
                  qkv_norm_stat=shapes["qkv"], qkv_stat=shapes["qkv"], gate_up_stat=shapes["gate_up"],
                  qkv_post=shapes["qkv"], gate_up_post=shapes["gate_up"], head_post=shapes["head"],
                  head_stat=shapes["head"])
    sums = row_sumsq_ref(x)  # what o_proj / down store for a launch with producer_stat (kernels/rmsnorm.py)
    post = dict(producer_stat=True, row_sumsq=sums, post_scale=True, scaled_x=scaled_rows_ref(x, nw))
    calls = {
        "qkv": lambda w, **p: rmsnorm_qkv_rope(x, nw, w, 1e-5, pos, slots, cos, sin, kc, vc, sh.heads, sh.kv_heads,
                                               **p),
        "o": lambda w, **p: linear(a, w, r, **p),
        "gate_up": lambda w, **p: rmsnorm_glu(x, nw, w, 1e-5, **p),  # N = I columns, each a gate and an up row
        "down": lambda w, **p: linear(act, w, r, **p),  # the engine's: SwiGLU runs in gate_up's epilogue
        # the norm launches' matrices read by a plain projection (no statistic, no epilogue): what the norm costs
        "qkv_linear": lambda w, **p: linear(x, w, **p),
        "gate_up_linear": lambda w, **p: linear(x, w, **p),
        # QKV's cost taken apart: the normed projection without the rotary epilogue (row pass / producer's sums),
        # and the engine's QKV and gate_up launches on producer statistics
        "qkv_norm": lambda w, **p: rmsnorm_linear(x, nw, w, 1e-5, **p),
        "qkv_norm_stat": lambda w, **p: rmsnorm_linear(x, nw, w, 1e-5, producer_stat=True, row_sumsq=sums, **p),
        "qkv_stat": lambda w, **p: rmsnorm_qkv_rope(x, nw, w, 1e-5, pos, slots, cos, sin, kc, vc, sh.heads,
                                                    sh.kv_heads, producer_stat=True, row_sumsq=sums, **p),
        "gate_up_stat": lambda w, **p: rmsnorm_glu(x, nw, w, 1e-5, producer_stat=True, row_sumsq=sums, **p),
        # post_scale: the producer's scaled rows projected as they are, rstd after the dot
        "qkv_post": lambda w, **p: rmsnorm_qkv_rope(x, nw, w, 1e-5, pos, slots, cos, sin, kc, vc, sh.heads,
                                                    sh.kv_heads, **post, **p),
        "gate_up_post": lambda w, **p: rmsnorm_glu(x, nw, w, 1e-5, **post, **p),
        "head_post": lambda w, **p: rmsnorm_linear(x, nw, w, 1e-5, out_dtype=torch.float32, argmax=True,
                                                   store_y=False, **post, **p),
        # the block drafter's head: its logits in fp32 for the top-k (no argmax, stored)
        "head_logits": lambda w, **p: rmsnorm_linear(x, nw, w, 1e-5, out_dtype=torch.float32, **p),
        # the engine's LM head on producer statistics (smollm2-135m-h200's table)
        "head_stat": lambda w, **p: rmsnorm_linear(x, nw, w, 1e-5, out_dtype=torch.float32, argmax=True,
                                                   store_y=False, producer_stat=True, row_sumsq=sums, **p),
        "head": lambda w, **p: rmsnorm_linear(x, nw, w, 1e-5, out_dtype=torch.float32, argmax=True, store_y=False,
                                              **p),
    }
    return calls[name], [rnd(*shapes[name]) for _ in range(copies)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--block-k", default="128,256,512,1024")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--split-k", default="1")
    ap.add_argument("--tile-rows", default="16", help="rows of a tensor-core tile (T-neutral: 16 or 32)")
    ap.add_argument("--kernels", default="qkv,o,gate_up,down,head")
    ap.add_argument("--copies", type=int, default=1, help="weight matrices per projection, rotated (>1: read from "
                    "HBM as in a step, not from L2)")
    a = ap.parse_args()
    sh, dev = SHAPES[a.shape], torch.device("cuda")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    tokens = ints(a.tokens)
    grid = list(itertools.product(ints(a.block_k), ints(a.block_n), ints(a.warps), ints(a.stages), ints(a.split_k),
                                  ints(a.tile_rows)))
    order = lambda key: tuple(int(v) for v in key.split(",")[::4])  # noqa: E731  (block_k, split_k)
    res, raw = {}, {}
    for name in a.kernels.split(","):
        per_t = {}
        for T in tokens:
            call, ws = kernels(sh, T, dev, name, a.copies)
            nbytes = ws[0].numel() * ws[0].element_size()
            rows = {"default": graph_us([lambda w=w: call(w) for w in ws])}
            for bk, bn, nw, st, sk, tr in grid:
                p = dict(block_k=bk, block_n=bn, num_warps=nw, num_stages=st, split_k=sk, tile_rows=tr)
                key = f"{bk},{bn},{nw},{st},{sk}" + (f",{tr}" if tr != 16 else "")
                try:
                    rows[key] = graph_us([lambda w=w: call(w, **p) for w in ws])
                except Exception:  # out of shared memory / registers for this tile: not a candidate
                    rows[key] = float("inf")
            per_t[T] = rows
        # block_k and split_k fix the reduction order: one pair per shape, chosen on the sum over T of each T's best
        pairs = sorted({order(k) for k in per_t[tokens[0]] if k != "default"})
        best_pair = min(pairs, key=lambda p: sum(min(v for k, v in per_t[T].items() if k != "default"
                                                     and order(k) == p) for T in tokens))
        res[name] = {"block_k,split_k": best_pair, "weight_bytes": nbytes, "per_t": {}}
        for T in tokens:
            cands = {k: v for k, v in per_t[T].items() if k != "default" and order(k) == best_pair}
            k_best = min(cands, key=cands.get)
            res[name]["per_t"][T] = {"default_us": per_t[T]["default"], "best_us": cands[k_best], "best": k_best,
                                     "best_any_us": min(v for k, v in per_t[T].items() if k != "default"),
                                     "best_any": min((k for k in per_t[T] if k != "default"), key=per_t[T].get)}
        raw[name] = per_t
        json.dump({"shape": a.shape, "results": res, "raw": raw}, open(a.out, "w"), indent=1)
        print(name, res[name], flush=True)
    print("| kernel | T | default us | GB/s | tuned us | GB/s | block_k,block_n,warps,stages,split_k[,tile_rows] | any us |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        gbs = lambda us: r["weight_bytes"] / us / 1e3  # noqa: E731
        for T, v in r["per_t"].items():
            print(f"| {name} | {T} | {v['default_us']:.2f} | {gbs(v['default_us']):.0f} | {v['best_us']:.2f} | "
                  f"{gbs(v['best_us']):.0f} | {v['best']} | {v['best_any_us']:.2f} ({v['best_any']}) |")


if __name__ == "__main__":
    main()
