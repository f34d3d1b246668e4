"""Where a batched forward's time goes on the GPU: the BatchRunner's captured step vs the single-request runner's.

Random SmolLM2-135M weights (bf16). For each (requests, tokens per request, context) case: the batched step's
wall time (launch + result, graph path, median of 30) and its kernels under torch.profiler, grouped by name
(us per step); then the single-request ModelRunner's one-token step at the same context for reference.
--drafter: instead, the same batched steps with a random block-16 drafter (2 layers) fed and drafting every row
inside the step's graph (launch(draft=True)) against the step without it: what drafting in the step costs.

--splits-per-program N: the paged attention's splits per program (engines.batch.paged_attn.SPLITS_PER_PROGRAM;
changes no bit), for an A/B.

Usage (PYTHONPATH=repo root): python scripts/gpu_batch_profile.py OUT.json [--max-seq-len 2560] [--drafter]
    [--splits-per-program N]
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

from specpilot.engines.batch import BatchBlockDrafter, BatchConfig, BatchRunner, paged_attn
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


def smollm2_batch_runner(max_seq_len: int = 2560, block_drafter: bool = False
                         ) -> tuple[BatchRunner, object, EngineConfig]:
    """(runner, model, cfg): random SmolLM2-135M weights in bf16 behind the batched bench's runner (24 rows,
    drafts up to 32 tokens, graphs up to 1024 tokens), optionally with a random block-16 drafter."""
    model = random_model(SMOLLM2_135M, torch.bfloat16, "cuda", seed=0)
    cfg = EngineConfig.from_dict({"dtype": "bfloat16", "max_seq_len": max_seq_len, "kernel_backend": "triton",
                                  "cuda_graphs": True, "drafter": "block" if block_drafter else "ngram"})
    drafter = None
    if block_drafter:
        d = BlockDrafterModel(BlockDrafterConfig.for_target(SMOLLM2_135M, layers=2, block_size=16)).init_weights(0)
        drafter = BatchBlockDrafter(d, model, 24, max_seq_len, "cuda")
    runner = BatchRunner(model, cfg, BatchConfig(max_batch=24, max_draft_len=32, graph_max_tokens=1024), "cuda",
                         max_block=33, drafters=[drafter] if drafter else [])
    return runner, model, cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--max-seq-len", type=int, default=2560)
    ap.add_argument("--drafter", action="store_true")
    ap.add_argument("--splits-per-program", type=int, default=None)
    a = ap.parse_args(argv)
    if a.splits_per_program is not None:
        paged_attn.SPLITS_PER_PROGRAM = a.splits_per_program
    runner, model, cfg = smollm2_batch_runner(a.max_seq_len, a.drafter)
    results = []
    cases = ((16, 8, 1024), (24, 6, 2048)) if a.drafter else \
        ((1, 1, 256), (16, 1, 256), (16, 1, 1024), (16, 6, 1024), (16, 16, 1024), (24, 6, 2048))
    with torch.no_grad():
        for requests, per, context in cases:
            pages = [runner.cache.allocate(context + 33) for _ in range(requests)]
            for r, p in enumerate(pages):
                runner.bind(r, p)
            entries = [StepEntry(r, [1] * per, context) for r in range(requests)]
            for draft in (False, True) if a.drafter else (False,):
                measure(results, f"batched {requests} x {per} tokens at context {context}"
                        + (f", drafting={draft}" if a.drafter else ""),
                        lambda: runner.launch(entries, draft=draft).result(), requests=requests,
                        tokens_per_request=per, context=context, draft=draft)
            for r, p in enumerate(pages):
                runner.unbind(r)
                runner.cache.release(p)
        if a.drafter:
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
