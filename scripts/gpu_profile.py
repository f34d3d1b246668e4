"""Where a decode step's time goes on the GPU (random weights: step time does not depend on weight values).

python3 scripts/gpu_profile.py OUT_DIR [--shapes smollm2,llama8b] [--tokens 256]

Per shape: the step graph's pure GPU time (CUDA events over replays) at widths 1 and 16, the engine's end-to-end
AR ms/token (so host overhead = end-to-end - graph), the per-kernel GPU time of one eager step (torch.profiler),
and for Llama-3-8B shapes the weight-bandwidth floor (weight bytes / the best measured HBM read bandwidth).
Prints a short table last; JSON in OUT_DIR/profile.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels.table import read_pairs

SHAPES = {"smollm2": SMOLLM2_135M, "llama8b": LLAMA3_8B}


def events_ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def hbm_read_gbs() -> float:
    """Best of a streaming reduction and a copy (copy moves 2x its size) over 2 GiB."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    t_sum = events_ms(lambda: x.sum(dtype=torch.float32), 20)
    t_copy = events_ms(lambda: y.copy_(x), 20)
    return max(nbytes / t_sum / 1e6, 2 * nbytes / t_copy / 1e6)


def kernel_table(runner, width: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    dev = runner.device
    ids = torch.zeros(width, dtype=torch.long, device=dev)
    pos = torch.arange(100, 100 + width, device=dev)
    base = torch.tensor(100, device=dev)
    anc = torch.eye(width, runner.block_width, dtype=torch.bool, device=dev)
    for _ in range(3):
        runner._step(ids, pos, pos, base, anc)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner._step(ids, pos, pos, base, anc)
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name[:60]].append(ev.device_time)
    rows = [{"kernel": k, "calls": len(v), "total_us": sum(v), "mean_us": sum(v) / len(v)} for k, v in agg.items()]
    return sorted(rows, key=lambda r: -r["total_us"])


def attention_table(shape, split_keys: int, block_n: int) -> tuple[tuple[str, str], ...]:
    """Kernel-table entry giving attention this reduction order at every token count."""
    from specpilot.kernels import AttentionParams
    from specpilot.kernels.table import table_key
    p = json.dumps(AttentionParams(block_n=block_n, split_keys=split_keys).as_kwargs(), sort_keys=True)
    return ((table_key("attention", shape.q_dim, shape.kv_dim, 1), p),)


def row_tile_table(shape, row_tile: int, split_k: int = 1) -> tuple[tuple[str, str], ...]:
    """Kernel-table entries putting every projection on `row_tile`-row tiles (its default block_n) and `split_k`
    K runs at every T."""
    from specpilot.stages.kernel_specs import projection_table
    return () if (row_tile, split_k) == (16, 1) else projection_table(shape, row_tile=row_tile, split_k=split_k)


def profile_shape(name: str, tokens: int, backend: str, attn: str = "", kernels: bool = True,
                  row_tile: int = 16, weight_format: str = "native", pdl: str = "", split_k: int = 1,
                  table_file: str = "") -> dict:
    """One engine's numbers; pdl = MODE[:PREFETCH_MIB[:LARGE_MODE]] names the kernels.pdl.GridDependency its graphs
    are captured with, the largest weight matrix its launches prefetch, and the mode of larger ones ("": defaults)."""
    from specpilot.kernels.pdl import grid_dependency, parse_grid_dependency
    if pdl:
        with grid_dependency(**parse_grid_dependency(pdl)):
            return {**profile_shape(name, tokens, backend, attn, kernels, row_tile, weight_format, split_k=split_k),
                    "pdl": pdl}
    shape = SHAPES[name]
    torch.manual_seed(0)
    model = random_model(shape, torch.bfloat16, "cuda", seed=0)
    # the bytes a step must read (the floor's numerator): not an untied input embedding, of which it reads a row a
    # token (before session 23 every parameter counted: the Llama-3-8B floor read 3.807 ms for 3.559)
    weight_bytes = shape.step_weight_count() * 2
    prompt = torch.randint(3, shape.vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist() * 3
    table = (attention_table(shape, *map(int, attn.split(":"))) if attn else ()) + row_tile_table(shape, row_tile,
                                                                                                   split_k)
    if table_file:  # a kernel tuner's table (its summary.json or a list of [key, params JSON] pairs)
        table += read_pairs(table_file)
    eng = build_engine(EngineConfig(drafter=DrafterKind.NONE, kernel_backend=backend, max_seq_len=2048,
                                    kernel_table=table, weight_format=weight_format), model, frozenset(), "cuda")
    eng.generate(prompt, tokens)  # same request size: the same graphs as the timed run
    torch.cuda.synchronize()
    r = eng.generate(prompt, tokens)
    e2e_ms = 1e3 * r.decode_s / tokens
    runner = eng.target
    out = {"shape": name, "backend": backend, "attn": attn, "row_tile": row_tile, "split_k": split_k,
           "table_file": table_file,
           "weight_bytes": weight_bytes,
           "weight_format": weight_format, "e2e_ar_ms": e2e_ms, "tokens": r.tokens}
    for width in (1, 2, 4, 8, 16):
        n = width
        runner.verify(150, list(range(3, 3 + n)), list(range(n)), np.tril(np.ones((n, n), bool)))
        key = next(k for k in runner._graphs if k[0] == (runner.tile or width))
        graph = runner._graphs[key].graph
        out[f"graph_ms_w{width}"] = events_ms(graph.replay, 100)
    out["kernels_w1"] = kernel_table(runner, runner.tile or 1) if kernels else []
    out["kernels_w16"] = kernel_table(runner, 16) if kernels else []
    del eng, runner, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--attn", default="", help="split_keys:block_n variants of attention, comma-separated")
    ap.add_argument("--row-tiles", default="16", help="projection row tiles to profile (16: tensor cores, 1: CUDA "
                                                       "cores, one row per program), comma-separated")
    ap.add_argument("--weight-formats", default="native", help="native,w12: also the 12-bit weights (same model; "
                                                              "its AR tokens must equal native's)")
    ap.add_argument("--grid-dependency", default="", help="MODE[:PREFETCH_MIB[:LARGE_MODE]] variants after the "
                                                          "default, e.g. off,wait_then_trigger:1024,wait_then_trigger:"
                                                          "16:wait_then_trigger_at_end (graph times only)")
    ap.add_argument("--split-k", default="", help="split-K factors of every projection to compare, e.g. 2,4")
    ap.add_argument("--kernel-tables", default="", help="kernel tables (JSON files, e.g. a tuner's summary.json) "
                                                         "to compare, comma-separated (each with every weight format)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "hbm_read_gbs": hbm_read_gbs(), "runs": []}
    for name in a.shapes.split(","):
        for backend in a.backends.split(","):
            t0 = time.time()
            tiles = [int(t) for t in a.row_tiles.split(",")]
            r = profile_shape(name, a.tokens, backend, row_tile=tiles[0])
            r["wall_s"] = time.time() - t0
            print(f"\n## {name} {backend}: top kernels at width 1 (us)")
            for k in r["kernels_w1"][:14]:
                print(f"  {k['total_us']:8.1f} {k['calls']:4d}x {k['mean_us']:6.2f}  {k['kernel']}")
            print(f"  sum {sum(k['total_us'] for k in r['kernels_w1']):.1f} us; launches "
                  f"{sum(k['calls'] for k in r['kernels_w1'])}", flush=True)
            variants = [r] + [profile_shape(name, a.tokens, backend, row_tile=t) for t in tiles[1:]] + [
                profile_shape(name, a.tokens, backend, attn, kernels=False) for attn in filter(None, a.attn.split(","))]
            variants += [profile_shape(name, a.tokens, backend, weight_format=w)
                         for w in a.weight_formats.split(",") if w != "native"]
            variants += [profile_shape(name, a.tokens, backend, kernels=False, pdl=m)
                         for m in filter(None, a.grid_dependency.split(","))]
            variants += [profile_shape(name, a.tokens, backend, kernels=False, split_k=int(sk))
                         for sk in filter(None, a.split_k.split(","))]
            variants += [profile_shape(name, a.tokens, backend, kernels=False, table_file=f, weight_format=w)
                         for f in filter(None, a.kernel_tables.split(",")) for w in a.weight_formats.split(",")]
            for v in variants:
                v["equal_to_native"] = v["tokens"] == r["tokens"]
            for v in variants[1:len(tiles)]:
                print(f"\n## {name} {backend} row_tile={v['row_tile']}: top kernels at width 1 (us)")
                for k in v["kernels_w1"][:8]:
                    print(f"  {k['total_us']:8.1f} {k['calls']:4d}x {k['mean_us']:6.2f}  {k['kernel']}")
            for v in variants:
                v["floor_ms"] = v["weight_bytes"] / res["hbm_read_gbs"] / 1e6
                res["runs"].append(v)
            json.dump(res, open(os.path.join(a.out, "profile.json"), "w"), indent=1)
    print(f"\nHBM read {res['hbm_read_gbs']:.0f} GB/s")
    print("| shape | backend | table | weights | rows | split-K | attn split:block | PDL | e2e AR ms | graph w1 | w2 | w4 | w8 | w16 | w16/w1 | "
          "floor ms | tokens = native |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        g = [r[f"graph_ms_w{w}"] for w in (1, 2, 4, 8, 16)]
        table = os.path.basename(r["table_file"]) or "default"
        print(f"| {r['shape']} | {r['backend']} | {table} | {r['weight_format']} | {r.get('row_tile', 16)} | {r['split_k']} | "
              f"{r['attn'] or 'default'} | {r.get('pdl') or 'default'} | {r['e2e_ar_ms']:.3f} | " + " | ".join(f"{v:.3f}" for v in g)
              + f" | {g[4] / g[0]:.2f} | {r['floor_ms']:.3f} | {'yes' if r['equal_to_native'] else 'NO'} |")


if __name__ == "__main__":
    main()
