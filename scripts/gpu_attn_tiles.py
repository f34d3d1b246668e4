"""Attention's T-neutral row settings on the GPU: tiles_per_program (row tiles one split program runs in turn) and
tile_rows (16 or 32 rows a tile): the same bits as one 16-row tile a program, and what each saves where a verify's
rows span several tiles (T * group > 16).

Per shape (SmolLM2-135M, Llama-3-8B heads), context and token count: the split + combine launches over one cache
per layer, CUDA-graph timed with the base on the device (as the engine runs them), us per layer, for each tiles
setting; every setting's output compared bit for bit with tiles 1. Prints a table last; JSON to OUT.

    PYTHONPATH=. python3 scripts/gpu_attn_tiles.py OUT.json [--tiles 1,2,4,1r32] [--contexts 128,1024,2048]
        [--tokens 1,16] [--shapes smollm2,llama8b] [--slots [--tree chain|random]]
    (an entry t, t r tile_rows, and w num_warps: "1r32" is one 32-row tile a program, "1r32w2" that with 2 warps;
    --slots: position-ordered, as a grown tree's verify runs it: a chain's block_slots, one stage; --tree random: a
    random tree's instead (each node's parent drawn from the nodes before it))
"""
from __future__ import annotations

import argparse
import json
import random
import re

import torch

from specpilot.engines.layout import tree_anc
from specpilot.engines.llama import ancestor_slots
from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels import attention
from specpilot.kernels.bench import time_graph


def setting(entry: str) -> dict:
    m = re.fullmatch(r"(\d+)(?:r(\d+))?(?:w(\d+))?", entry)
    if m is None:
        raise ValueError(f"tiles entry {entry!r}: expected T[rROWS][wWARPS], e.g. 1r32w2")
    tiles, rows, warps = m.groups()
    return {"tiles_per_program": int(tiles), "tile_rows": int(rows or 16), **({"num_warps": int(warps)} if warps else {})}


def case(name: str, sh, context: int, T: int, tiles: list[str], slots: bool, tree: str = "chain", layers: int = 8,
         S: int = 4096) -> dict:
    g = torch.Generator(device="cuda").manual_seed(context + T)
    caches = [tuple(torch.randn(sh.kv_heads, S, sh.head_dim, generator=g, device="cuda").to(torch.bfloat16)
                    for _ in range(2)) for _ in range(layers)]
    q = torch.randn(T, sh.heads, sh.head_dim, generator=g, device="cuda").to(torch.bfloat16)
    base = torch.tensor([context], device="cuda")
    rng = random.Random(context + T)
    parents = list(range(-1, T - 1)) if tree == "chain" else [-1] + [rng.randrange(i) for i in range(1, T)]
    anc = torch.from_numpy(tree_anc(parents)).to("cuda")
    row = {"shape": name, "context": context, "T": T, "slots": slots, "tree": tree}
    kw0 = {}
    if slots:  # token i reads position base + e from the slot of its ancestor at depth e
        kw0 = {"block_slots": ancestor_slots(base[0], anc)}
    want = attention(q, *caches[0], base, anc, **kw0)
    for t in tiles:
        kw = kw0 | setting(t)
        got = attention(q, *caches[0], base, anc, **kw)
        row[f"equal_{t}"] = bool(torch.equal(got, want))
        fns = [lambda kc=kc, vc=vc: attention(q, kc, vc, base, anc, **kw) for kc, vc in caches]
        row[f"us_{t}"] = round(1e3 * time_graph(fns, 50), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiles", default="1,2,4")
    ap.add_argument("--contexts", default="128,1024,2048")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--slots", action="store_true")
    ap.add_argument("--tree", choices=("chain", "random"), default="chain",
                    help="the block's tree (its anc; with --slots its block_slots too)")
    a = ap.parse_args()
    tiles = a.tiles.split(",")
    shapes = [(name, {"smollm2": SMOLLM2_135M, "llama8b": LLAMA3_8B}[name]) for name in a.shapes.split(",")]
    rows = [case(name, sh, c, T, tiles, a.slots, a.tree) for name, sh in shapes for c in map(int, a.contexts.split(","))
            for T in map(int, a.tokens.split(","))]
    json.dump(rows, open(a.out, "w"), indent=1)
    print("| shape | context | T | " + " | ".join(f"tiles {t} us (bits equal)" for t in tiles) + " |")
    print("|---|---|---|" + "---|" * len(tiles))
    for r in rows:
        print(f"| {r['shape']} | {r['context']} | {r['T']} | "
              + " | ".join(f"{r[f'us_{t}']} ({r[f'equal_{t}']})" for t in tiles) + " |")


if __name__ == "__main__":
    main()
