"""What one batched block-drafter draft costs on the GPU (random SmolLM2-135M target, random block-16 drafter).

python3 scripts/gpu_batch_draft.py OUT.json [--rows 16,20,24] [--capacity 2560] [--reps 50]
Per row count and LM head (the fused norm + head + argmax kernel, or cuBLAS GEMM + argmax: the drafter's default
picks by rows x depth): BatchBlockDrafter.draft's wall time (one captured-graph replay, the input upload and the read of
the drafts) and the kernels it runs, by device time: inside a batched step (BatchRunner with the drafter) the same
kernels run in the step's graph after the verify. The session-16 H200 run of the first version (the reference
model's SDPA over repeated keys, logits through a cuBLAS GEMM) took 2.49 ms at 24 rows.
"""
import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specpilot.engines.batch.block_drafting import BatchBlockDrafter
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import SMOLLM2_135M

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--rows", default="16,20,24")
ap.add_argument("--capacity", type=int, default=2560)
ap.add_argument("--reps", type=int, default=50)
args = ap.parse_args()
target = random_model(SMOLLM2_135M, torch.bfloat16, "cuda", seed=0)
model = BlockDrafterModel(BlockDrafterConfig.for_target(SMOLLM2_135M, layers=2, block_size=16)).init_weights(0)
res = {"device": torch.cuda.get_device_name(), "capacity": args.capacity, "rows": {}}
for rows, fused in ((int(r), f) for r in args.rows.split(",") for f in (True, False)):
    drafter = BatchBlockDrafter(model, target, rows, args.capacity, "cuda", triton_head=fused)
    ids, pending, positions = list(range(rows)), [5] * rows, [args.capacity // 2 + i for i in range(rows)]
    for _ in range(3):
        drafter.draft(ids, pending, positions)
    t = time.perf_counter()
    for _ in range(args.reps):
        drafter.draft(ids, pending, positions)
    ms = 1e3 * (time.perf_counter() - t) / args.reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        drafter.draft(ids, pending, positions)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels[e.name[:80]] = kernels.get(e.name[:80], 0.0) + e.device_time
    head = "fused" if fused else "gemm"
    res["rows"][f"{rows} {head}"] = {"rows": rows, "head": head, "draft_ms": ms, "device_us": sum(kernels.values()),
                                     "top": sorted(kernels.items(), key=lambda kv: -kv[1])[:10]}
    del drafter
json.dump(res, open(args.out, "w"), indent=1)
print("| rows | head | draft ms | kernel us |\n|---|---|---|---|")
for r in res["rows"].values():
    print(f"| {r['rows']} | {r['head']} | {r['draft_ms']:.3f} | {r['device_us']:.0f} |")
for name, us in list(res["rows"].values())[-1]["top"]:
    print(f"  {us:8.1f} us  {name}")
