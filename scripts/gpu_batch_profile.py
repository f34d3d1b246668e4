"""Where a batched forward's time goes on the GPU: the BatchRunner's captured step vs the single-request runner's.

Random SmolLM2-135M weights (bf16). For each (requests, tokens per request, context) case: the batched step's
wall time (launch + result, graph path, median of 30) and its kernels under torch.profiler, grouped by name
(us per step); then the single-request ModelRunner's one-token step at the same context for reference.
--drafter: instead, the same batched steps with a random block-16 drafter (2 layers) fed and drafting every row
inside the step's graph (launch(draft=True)) against the step without it: what drafting in the step costs.

--splits-per-program N: the paged attention's splits per program (engines.batch.paged_attn.SPLITS_PER_PROGRAM;
changes no bit), for an A/B.

--row-tile 32: every projection (qkv, o_proj, gate_up, down, lm_head) of the batched runner in 32-token tiles instead
of 16 (a kernel table), after checking fused_forward's logits, argmax and KV with that table against the default's,
bit for bit, at several token counts (exit 1 on a difference).

--lookup: the same cases stepped three ways: without drafting, drafting every row with the device n-gram lookup
(device_draft), and with the lookup plus the device policy (goodput and verify budget) and extrapolation (the "all"
variant's step): what the lookup and the policy add to a step on the device. --eager: the policy and the
extrapolation not torch.compile'd (their default on CUDA).

--attention JSON: the attention's reduction order for the whole runner (split_keys = the KV page size, block_n), as a
kernel table entry (what a tuned table would set; the single-request reference gets it too). --cases
RxTxC,...: (requests, tokens per request, context) cases instead of the default ones; --skip-single: no
single-request reference.

Usage (PYTHONPATH=repo root): python scripts/gpu_batch_profile.py OUT.json [--max-seq-len 2560] [--drafter]
    [--splits-per-program N] [--attention '{"split_keys": 128, "block_n": 64}'] [--cases 16x6x2048] [--skip-single]
    [--lookup]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from specpilot.engines.batch import (BatchBlockDrafter, BatchConfig, BatchNgramDrafter, BatchRunner, CostCurve,
                                    DevicePolicy, paged_attn)
from specpilot.engines.batch.runner import StepEntry
from specpilot.engines.config import EngineConfig
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.loader import random_model
from specpilot.engines.runner import ModelRunner
from specpilot.engines.shapes import SMOLLM2_135M


def kernel_table(fn, reps: int = 5, top: int = 10) -> list[tuple[str, int, float]]:
    """(kernel name, launches per step, us per step), the top ones by time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:60]] += e.device_time / reps
            count[e.name[:60]] += 1
    rows = sorted(total, key=total.get, reverse=True)
    return [(n, count[n] // reps, round(total[n], 1)) for n in rows[:top]] + \
        [("(all kernels)", sum(count.values()) // reps, round(sum(total.values()), 1))]


def wall(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(results: list[dict], label: str, step, **case) -> None:
    """Wall time and kernels of `step`, printed and appended to results."""
    ms, kernels = wall(step), kernel_table(step)
    results.append({**case, "ms": ms, "kernels": kernels})
    print(f"{label}: {ms:.3f} ms", flush=True)
    for name, n, us in kernels:
        print(f"   {us:8.1f} us  {n:4d}x  {name}")


def row_tile_table(model, row_tile: int) -> tuple[tuple[str, str], ...]:
    """A kernel table putting every projection of `model` in row_tile-token tiles (every T: one entry a shape)."""
    from specpilot.kernels import _common
    from specpilot.kernels.table import table_key
    if row_tile not in _common.ROW_TILES:
        _common.ROW_TILES = (*_common.ROW_TILES, row_tile)
    sh = model.shape
    shapes = {"qkv": (sh.q_dim + 2 * sh.kv_heads * sh.head_dim, sh.hidden), "o_proj": (sh.hidden, sh.q_dim),
              "gate_up": (2 * sh.intermediate, sh.hidden), "down": (sh.hidden, sh.intermediate),
              "lm_head": (sh.vocab, sh.hidden)}
    return tuple((table_key(k, n, kk, 16), json.dumps({"row_tile": row_tile})) for k, (n, kk) in shapes.items())


def check_row_tile_bits(model, pairs) -> bool:
    """fused_forward with the table vs without: logits, argmax and the KV written, bitwise, per token count."""
    from specpilot.engines.fused import fused_forward, rope_tables_for
    sh = model.shape
    plain, tiled = rope_tables_for(model, 4096, "cuda"), rope_tables_for(model, 4096, "cuda", kernel_table=pairs)
    ok = True
    for T in (1, 5, 16, 33, 96, 112, 200):
        ids = torch.randint(0, sh.vocab, (T,), device="cuda", generator=torch.Generator("cuda").manual_seed(T))
        pos = torch.arange(T, device="cuda")
        anc = torch.tril(torch.ones(T, T, dtype=torch.bool, device="cuda"))
        outs = []
        for tables in (plain, tiled):
            kv = torch.zeros(2, sh.layers, sh.kv_heads, 256, sh.head_dim, dtype=torch.bfloat16, device="cuda")
            logits, argmax, _ = fused_forward(model, tables, ids, pos, pos, torch.tensor([0], device="cuda"), anc,
                                              kv[0], kv[1])
            outs.append((logits, argmax, kv))
        same = all(torch.equal(a, b) for a, b in zip(*outs))
        ok &= same
        print(f"{'ok  ' if same else 'DIFF'} row tiles 16 vs 32, T={T}: logits, argmax, KV", flush=True)
    return ok


def attention_table(model, order: dict) -> tuple[tuple[str, str], ...]:
    """A kernel table setting the attention's reduction order (every T) for `model`."""
    from specpilot.kernels.table import table_key
    sh = model.shape
    return ((table_key("attention", sh.q_dim, sh.kv_dim, 1), json.dumps(order)),)


def lookups(cfg: EngineConfig, rows: int, vocab: int, compiled: bool = True) -> list[BatchNgramDrafter]:
    """device_draft's lookup, and all's (with the device policy, staged as one "all" step, and extrapolation)."""
    policy = DevicePolicy(rows, 32, "cuda", compiled=compiled)
    policy.set_curve(CostCurve(((1, 1.05e-3), (16, 1.11e-3), (64, 1.51e-3), (128, 1.88e-3), (1024, 8e-3))))
    policy.stage(goodput=True, budget=True, k_max=32, fixed_s=1.1e-3, token_s=6e-6, overhead_s=4e-4, budget_cap=0,
                 prior=0.5, decay=0.7, remaining={r: 1000 for r in range(rows)}, fresh=[])
    return [BatchNgramDrafter(rows, cfg.max_seq_len, 32, cfg.ngram_min, cfg.ngram_max, "cuda"),
            BatchNgramDrafter(rows, cfg.max_seq_len, 32, cfg.ngram_min, cfg.ngram_max, "cuda", policy=policy,
                              extrapolate=True, vocab=vocab, compiled=compiled)]


def smollm2_batch_runner(max_seq_len: int = 2560, block_drafter: bool = False, row_tile: int = 16,
                         attention: dict | None = None, lookup: bool = False, compiled: bool = True
                         ) -> tuple[BatchRunner, object, EngineConfig]:
    """(runner, model, cfg): random SmolLM2-135M weights in bf16 behind the batched bench's runner (24 rows,
    drafts up to 32 tokens, graphs up to 1024 tokens), optionally with a random block-16 drafter."""
    model = random_model(SMOLLM2_135M, torch.bfloat16, "cuda", seed=0)
    cfg = EngineConfig.from_dict({"dtype": "bfloat16", "max_seq_len": max_seq_len, "kernel_backend": "triton",
                                  "cuda_graphs": True, "drafter": "block" if block_drafter else "ngram"})
    if row_tile != 16:
        pairs = row_tile_table(model, row_tile)
        if not check_row_tile_bits(model, pairs):
            raise SystemExit(1)
        cfg = cfg.replace(kernel_table=pairs)
    if attention:
        cfg = cfg.replace(kernel_table=cfg.kernel_table + attention_table(model, attention))
    drafter = None
    if block_drafter:
        d = BlockDrafterModel(BlockDrafterConfig.for_target(SMOLLM2_135M, layers=2, block_size=16)).init_weights(0)
        drafter = BatchBlockDrafter(d, model, 24, max_seq_len, "cuda")
    drafters = [drafter] if drafter else lookups(cfg, 24, SMOLLM2_135M.vocab, compiled) if lookup else []
    runner = BatchRunner(model, cfg, BatchConfig(max_batch=24, max_draft_len=32, graph_max_tokens=1024), "cuda",
                         max_block=33, drafters=drafters)
    return runner, model, cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--max-seq-len", type=int, default=2560)
    ap.add_argument("--drafter", action="store_true")
    ap.add_argument("--splits-per-program", type=int, default=None)
    ap.add_argument("--row-tile", type=int, default=16)
    ap.add_argument("--attention", default=None, help="JSON: split_keys / block_n for every attention call")
    ap.add_argument("--cases", default=None, help="RxTxC,...: requests x tokens per request x context")
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--lookup", action="store_true")
    ap.add_argument("--eager", action="store_true", help="--lookup: the policy and extrapolation not compiled")
    a = ap.parse_args(argv)
    if a.splits_per_program is not None:
        paged_attn.SPLITS_PER_PROGRAM = a.splits_per_program
    runner, model, cfg = smollm2_batch_runner(a.max_seq_len, a.drafter, a.row_tile,
                                              json.loads(a.attention) if a.attention else None, a.lookup,
                                              not a.eager)
    print(f"attention page {runner.page} keys", flush=True)
    results = []
    cases = ((16, 8, 1024), (24, 6, 2048)) if a.drafter else \
        ((1, 1, 256), (16, 1, 256), (16, 1, 1024), (16, 6, 1024), (16, 16, 1024), (24, 6, 2048), (24, 3, 1024),
         (24, 5, 1024))
    if a.cases:
        cases = tuple(tuple(int(x) for x in c.split("x")) for c in a.cases.split(","))
    with torch.no_grad():
        for requests, per, context in cases:
            pages = [runner.cache.allocate(context + 33) for _ in range(requests)]
            for r, p in enumerate(pages):
                runner.bind(r, p)
            entries = [StepEntry(r, [1] * per, context) for r in range(requests)]
            steps = {"plain": None, "lookup": runner.drafters[0], "lookup+policy+extrapolate": runner.drafters[1]} \
                if a.lookup else {"drafting=False": None, "drafting=True": True} if a.drafter else {"": None}
            for name, draft in steps.items():
                measure(results, f"batched {requests} x {per} tokens at context {context}" + (f", {name}" if name else ""),
                        lambda: runner.launch(entries, draft=draft).result(), requests=requests,
                        tokens_per_request=per, context=context, draft=name or False)
            for r, p in enumerate(pages):
                runner.unbind(r)
                runner.cache.release(p)
        if a.drafter or a.lookup or a.skip_single:
            Path(a.out).write_text(json.dumps(results, indent=1))
            return 0
        single = ModelRunner(model, cfg.replace(drafter="none"), "cuda", block_width=16)
        single.capture_all()
        for context in (256, 1024):
            single.begin_request(context + 64)
            single.prefill([1] * context)
            for per in (1, 16):
                anc = np.tril(np.ones((per, per), dtype=bool))
                measure(results, f"single request, {per} tokens at context {context}",
                        lambda: single.verify(context, [1] * per, list(range(per)), anc), single=True, tokens=per,
                        context=context)
    Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
