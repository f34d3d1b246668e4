"""Position-ordered tree attention (kernels.attn block_slots) on the GPU: bit-exact against AR and its cost.

python3 scripts/gpu_attn_slots.py [--contexts 256,1024,2048] [--launches 2:1,1:1,1:2]
For a 16-node tree at each context (SmolLM2 heads: 9 query, 3 KV, head_dim 64, bf16): (1) every node's output equals,
bit for bit, a one-token AR query over a cache with its path moved into position order; (2) microseconds per call
of the attention without slots (a chain's verify) and with them (a tree's), CUDA-graph replays.
"""
import argparse

import torch

import specpilot.kernels as K
from specpilot.engines.layout import tree_anc
from specpilot.engines.llama import ancestor_slots

ap = argparse.ArgumentParser()
ap.add_argument("--contexts", default="256,1024,2048")
ap.add_argument("--launches", default="2:1", help="num_stages:tiles_per_program, comma-separated")
ap.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1 (no timing)")
args = ap.parse_args()
dev, dt = torch.device(args.device), torch.bfloat16
H, KVH, D, S, T = 9, 3, 64, 4096, 16
parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 6, 7, 9, 10, 12, 13]
anc = torch.from_numpy(tree_anc(parents)).to(dev)


def timed(fn, reps=200):
    if dev.type != "cuda":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // 20):
        g.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000 / reps


launches = [dict(zip(("num_stages", "tiles_per_program"), map(int, v.split(":")))) for v in args.launches.split(",")]
print("| context | stages:tiles | nodes bit-equal to AR | chain us | tree (slots) us | ratio |")
print("|---|---|---|---|---|---|")
for ctx in (int(c) for c in args.contexts.split(",")):
    g = torch.Generator(device=dev).manual_seed(ctx)
    q = torch.randn(T, H, D, generator=g, device=dev).to(dt)
    kc, vc = (torch.randn(KVH, S, D, generator=g, device=dev).to(dt) for _ in range(2))
    base = torch.tensor([ctx], device=dev)
    bs = ancestor_slots(base[0], anc)
    tree = K.attention(q, kc, vc, base, anc, block_slots=bs, **launches[0])
    equal = 0
    for node in range(T):
        path, n = [], node
        while n >= 0:
            path.append(n)
            n = parents[n]
        path.reverse()
        kc2, vc2 = kc.clone(), vc.clone()
        for d, p in enumerate(path):
            kc2[:, ctx + d], vc2[:, ctx + d] = kc[:, ctx + p], vc[:, ctx + p]
        one = torch.ones(1, 1, dtype=torch.bool, device=dev)
        b1 = torch.tensor([ctx + len(path) - 1], device=dev)
        ar = K.attention(q[node:node + 1], kc2, vc2, b1, one, block_slots=ancestor_slots(b1[0], one))
        equal += bool(torch.equal(ar[0], tree[node]))
    chain = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    for lp in launches:
        same = torch.equal(K.attention(q, kc, vc, base, anc, block_slots=bs, **lp), tree)
        chain_us = timed(lambda: K.attention(q, kc, vc, base, chain, **lp))  # noqa: B023
        tree_us = timed(lambda: K.attention(q, kc, vc, base, anc, block_slots=bs, **lp))  # noqa: B023
        label = f"{lp['num_stages']}:{lp['tiles_per_program']}"
        print(f"| {ctx} | {label} | {equal}/{T}{'' if same else ' (not the first launch bits)'} | {chain_us:.1f} | "
              f"{tree_us:.1f} | {tree_us / chain_us:.2f} |")
