"""Hybrid (Qwen3-Next) verify cost on one GPU: a 16-node tree vs a 16-token chain at Qwen3-Next-80B's layer shapes.

Builds the first --layers layers of Qwen3-Next-80B-A3B (default 4: 3 Gated DeltaNet + 1 gated attention, each with
the 512-expert MoE; random bf16 weights), prefills a random context, and verifies one block per case through the
engine's HybridRunner (Triton tree scan, CUDA graphs, token tile 16: 17 rows run as two forwards): a chain of --nodes
drafts; a --nodes-node tree (a main path of --tree-depth nodes plus leaf alternatives, as best-first drafters grow
them: cost.example_tree) run depth-first; the same tree in drafter order; each at every --spacings checkpoint
spacing. Per case, CUDA events, median over --iters: the verify forwards (graph replays), the commit of the deepest
main-path node, and the Triton scan alone over every GDN layer (one graph). It reports the recurrent-state bytes one
verify + commit moves against the floor (read the committed state once, write the new one once:
cost.verify_state_traffic) and both at the copy bandwidth measured here, and checks that the tree's main path
gets the chain's tokens and logit margins. Target (issue 8): tree / chain <= 1.3 (verify + commit, first spacing).
Writes JSON (partial results and the traceback on an error) and prints a short table last.

GPU:  PYTHONPATH=. python scripts/gpu_hybrid_tree_vs_chain.py OUT.json
CPU:  PYTHONPATH=. python scripts/gpu_hybrid_tree_vs_chain.py --tiny OUT.json   (tiny shapes, TRITON_INTERPRET=1)
Needs only torch, triton and numpy besides specpilot.engines/kernels (no prefect, duckdb or boto3).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

TARGET_RATIO = 1.3
TILE = 16  # the engine's default token tile: a 17-row block runs as two 16-row forwards


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="path of the JSON results")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    p.add_argument("--layers", type=int, default=4, help="first N layers of the 80B (4 = 3 GDN + 1 attention)")
    p.add_argument("--nodes", type=int, default=16, help="draft nodes per block (chain length = tree size)")
    p.add_argument("--tree-depth", type=int, default=8, help="main-path depth of the tree")
    p.add_argument("--context", type=int, default=256, help="prefilled tokens before the block")
    p.add_argument("--spacings", default="1,16",
                   help="state checkpoint spacings to time, comma-separated; the first is the headline ratio's")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:  # the interpreter runs each kernel program in Python: a logic check, not a measurement
        args.iters, args.warmup, args.context = min(args.iters, 2), 0, min(args.context, 16)
    try:
        args.spacings = [int(s) for s in str(args.spacings).split(",")]
    except ValueError:
        p.error(f"--spacings {args.spacings!r}: expected comma-separated integers")
    if not 1 <= args.tree_depth <= args.nodes or args.layers < 1 or args.iters < 1 or args.context < 1 \
            or not args.spacings or min(args.spacings) < 1:
        p.error("need 1 <= --tree-depth <= --nodes, --layers, --iters, --context and every spacing >= 1")
    return args


def timer(torch, cuda: bool) -> Callable[[Callable[[], Any], int, int], list[float]]:
    """ms per call: CUDA events around each call (the device timeline), or wall time on CPU."""
    def run(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        if not cuda:
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]
    return run


def copy_bandwidth(torch, device, time_ms) -> float:
    """Bytes/s of a large device copy (read + write): the floor's bandwidth, measured rather than looked up."""
    n = (256 if device.type == "cuda" else 16) << 20
    src, dst = torch.ones(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    ms = statistics.median(time_ms(lambda: dst.copy_(src), 10, 2))
    return 2 * n / (ms * 1e-3)


def main_path(parents: list[int]) -> list[int]:
    """Block rows from the root to the deepest node (the tree's main path; the whole block for a chain)."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    node, path = max(range(len(parents)), key=lambda i: (depth[i], -i)), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import numpy as np
    import torch
    import triton

    from specpilot.engines.config import EngineConfig
    from specpilot.engines.hybrid.config import QWEN3_NEXT_80B, QWEN3_NEXT_TINY, GdnBackend, HybridConfig, LayerKind
    from specpilot.engines.hybrid.cost import block_parents, example_tree, verify_state_traffic
    from specpilot.engines.hybrid.model import random_hybrid_model
    from specpilot.engines.hybrid.runner import HybridRunner
    from specpilot.engines.layout import tree_anc
    from specpilot.kernels import gdn

    cuda = not args.tiny
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    # --tiny: one GDN layer (grouped heads) and one attention layer: the interpreter's cost is per program and row
    full = QWEN3_NEXT_80B if not args.tiny else dataclasses.replace(
        QWEN3_NEXT_TINY, layer_kinds=(LayerKind.LINEAR, LayerKind.FULL), sparse_layers=(True, True), lin_k_heads=1,
        lin_v_heads=2)
    shape = full.first_layers(min(args.layers, full.layers))
    time_ms = timer(torch, cuda)
    result["env"] = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                     "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
                     "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}
    result["shape"] = {"layers": shape.layers, "gdn_layers": len(shape.gdn_layers), "hidden": shape.hidden,
                       "lin_k_heads": shape.lin_k_heads, "lin_v_heads": shape.lin_v_heads, "d_k": shape.lin_k_dim,
                       "d_v": shape.lin_v_dim, "experts": shape.experts, "state_bytes_per_layer": 4 * shape.state_elems}
    model = random_hybrid_model(shape, dtype, device, seed=args.seed)
    rows = args.nodes + 1
    cfg = EngineConfig(drafter="none", dtype="bfloat16" if cuda else "float32", token_tile=TILE, cuda_graphs=True,
                       max_seq_len=max(64, args.context + 2 * TILE + rows))
    gen = torch.Generator().manual_seed(args.seed)
    context = torch.randint(3, shape.vocab, (args.context,), generator=gen).tolist()
    chain_tokens = torch.randint(3, shape.vocab, (rows,), generator=gen).tolist()
    tree_parents = block_parents(example_tree(args.nodes, args.tree_depth))
    tree_tokens = torch.randint(3, shape.vocab, (rows,), generator=gen).tolist()
    for d, row in enumerate(main_path(tree_parents)):  # the tree's main path drafts the chain's first tokens
        tree_tokens[row] = chain_tokens[d]
    cases = {"chain": (block_parents(list(range(-1, args.nodes - 1))), chain_tokens, True),
             "tree": (tree_parents, tree_tokens, True), "tree_drafter_order": (tree_parents, tree_tokens, False)}
    bandwidth = copy_bandwidth(torch, device, time_ms)
    result["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    result["cases"], result["ratios"] = {}, {}
    for spacing in args.spacings:
        outs = {}
        for name, (parents, tokens, dfs) in cases.items():
            hybrid = HybridConfig(verify_tree=True, state_checkpoint_spacing=spacing, dfs_order=dfs,
                                  gdn_backend=GdnBackend.TRITON)
            runner = HybridRunner(model, cfg, hybrid, device, block_width=rows)
            runner.prefill(context)
            depths = [0] * rows
            for i in range(1, rows):
                depths[i] = depths[parents[i]] + 1
            outs[name] = runner.verify(len(context), tokens, depths, tree_anc(parents))
            sched, row = runner.pending_commit(main_path(parents)[-1])
            traffic = verify_state_traffic(shape, sched, row, act_bytes=torch.finfo(dtype).bits // 8)
            verify = time_ms(runner.replay_verify, args.iters, args.warmup)
            commit = time_ms(functools.partial(runner.rec.commit, sched, row, hybrid.gdn_backend), args.iters,
                             args.warmup)
            scan, scan_mode = scan_timing(torch, gdn, runner, sched, cuda, time_ms, args)
            v, c = statistics.median(verify), statistics.median(commit)
            result["cases"][f"{name}@s{spacing}"] = {
                "case": name, "spacing": spacing, "rows": rows, "accepted_depth": sched.depths[row],
                "forwards": -(-sched.rows // sched.chunk), "stored_states": sched.stored,
                "resumed_states": sched.resumes(), "graphs": [list(k) for k in runner.graphs.captured],
                "verify_ms": round(v, 4), "commit_ms": round(c, 4), "total_ms": round(v + c, 4),
                "verify_ms_p10_p90": [round(float(np.percentile(verify, q)), 4) for q in (10, 90)],
                "scan_us": round(statistics.median(scan) * 1e3, 2), "scan_mode": scan_mode,
                "state_read_bytes": traffic.read, "state_written_bytes": traffic.written,
                "state_bytes": traffic.total, "floor_bytes": traffic.floor, "over_floor": round(traffic.over_floor, 3),
                "floor_us_at_copy_bw": round(traffic.floor / bandwidth * 1e6, 2),
                "state_us_at_copy_bw": round(traffic.total / bandwidth * 1e6, 2),
                "state_bytes_full_model": traffic.total * len(full.gdn_layers) // len(shape.gdn_layers)}
            del runner
            if cuda:
                torch.cuda.empty_cache()
        cs = {name: result["cases"][f"{name}@s{spacing}"] for name in cases}
        tree_path = main_path(tree_parents)
        same = [outs["chain"].argmax[d] for d in range(len(tree_path))] == [outs["tree"].argmax[r] for r in tree_path]
        bits = torch.equal(outs["chain"].margin[:len(tree_path)].cpu(),
                           outs["tree"].margin[torch.tensor(tree_path, device=outs["tree"].margin.device)].cpu())
        result["ratios"][f"s{spacing}"] = {
            "tree_vs_chain": round(cs["tree"]["total_ms"] / cs["chain"]["total_ms"], 4),
            "tree_vs_chain_scan": round(cs["tree"]["scan_us"] / cs["chain"]["scan_us"], 4),
            "drafter_order_vs_chain": round(cs["tree_drafter_order"]["total_ms"] / cs["chain"]["total_ms"], 4),
            "main_path_tokens_equal_chain": bool(same), "main_path_margins_bitwise_equal_chain": bool(bits)}
    headline = result["ratios"][f"s{args.spacings[0]}"]
    result["ratio_tree_vs_chain"], result["target_ratio"] = headline["tree_vs_chain"], TARGET_RATIO
    result["meets_target"] = headline["tree_vs_chain"] <= TARGET_RATIO


def scan_timing(torch, gdn, runner, sched, cuda: bool, time_ms, args) -> tuple[list[float], str]:
    """The Triton tree scan alone, every GDN layer, the block's schedule and forward chunks, on the inputs the verify
    saved (k stands in for q, which changes no state). One CUDA graph of all launches when it captures, else eager."""
    rec, n, width = runner.rec, sched.rows, runner.tile or runner.rows
    dev = rec.state.device
    parents = torch.tensor(sched.parents, device=dev)
    hold = torch.tensor(sched.hold, dtype=torch.long, device=dev)
    store = torch.tensor(sched.store, device=dev)
    calls = []
    for layer in range(rec.state.shape[0]):
        for s in range(0, n, width):
            e = min(n, s + width)
            k = rec.k[layer, s:e]
            calls.append((k, k, rec.v[layer, s:e], rec.g[layer, s:e], rec.beta[layer, s:e], parents[s:e], hold[s:e],
                          store, rec.state[layer], rec.nodes[layer], s))

    def scan() -> None:
        for *inputs, offset in calls:
            gdn.tree_gdn(*inputs, offset=offset)

    if cuda:
        try:
            scan()  # compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                scan()
            return time_ms(graph.replay, args.iters, args.warmup), "cuda_graph"
        except Exception as e:  # noqa: BLE001 - eager launches still measure the kernels, with launch gaps
            torch.cuda.synchronize()
            print(f"scan graph capture failed ({e!r}); timing eager launches", file=sys.stderr)
    return time_ms(scan, args.iters, args.warmup), "eager"


def table(result: dict[str, Any]) -> str:
    lines = ["| case | spacing | verify ms | commit ms | total ms | scan us | stored | resumed | state MB | floor MB |"
             " x floor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"].values():
        lines.append(f"| {c['case']} | {c['spacing']} | {c['verify_ms']:.3f} | {c['commit_ms']:.3f} | "
                     f"{c['total_ms']:.3f} | {c['scan_us']:.1f} | {c['stored_states']} | {c['resumed_states']} | "
                     f"{c['state_bytes'] / 2**20:.2f} | {c['floor_bytes'] / 2**20:.2f} | {c['over_floor']:.2f} |")
    for key, r in result["ratios"].items():
        lines.append(f"{key}: tree/chain verify+commit {r['tree_vs_chain']:.3f}x, scan alone "
                     f"{r['tree_vs_chain_scan']:.3f}x, drafter order {r['drafter_order_vs_chain']:.3f}x; main path "
                     f"== chain: tokens {r['main_path_tokens_equal_chain']}, "
                     f"margins bitwise {r['main_path_margins_bitwise_equal_chain']}")
    ok = "PASS" if result["meets_target"] else "FAIL"
    lines.append(f"tree/chain = {result['ratio_tree_vs_chain']:.3f}x at spacing {result['args']['spacings'][0]} "
                 f"(target <= {TARGET_RATIO}x: {ok}) on {result['env']['device']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before specpilot.kernels builds its kernels (on import)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device here: pass --tiny for the CPU logic check", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args), "status": "started"}
    try:
        run(args, result)
        result["status"] = "ok"
    except Exception:  # noqa: BLE001 - keep what was measured, and the traceback, in the JSON
        result["status"], result["error"] = "error", traceback.format_exc()
        out.write_text(json.dumps(result, indent=1))
        print(result["error"], file=sys.stderr)
        return 1
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
