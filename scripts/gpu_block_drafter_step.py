"""Where a block-drafter step's time goes (random SmolLM2-135M target, random 2-layer block-16 drafter).

python3 scripts/gpu_block_drafter_step.py OUT_DIR [--device cpu] [--tokens N]
(a) the draft graph: one replay + sync (BlockTreeDrafter.distributions); (b) the observe graph of n accepted
tokens, replayed alone (n = 1, 4, 16); (c) SpecEngine.generate with chain verification: ms/token, tokens/step
and each step's draft/verify split; (d) kernels launched by (a) and (b), from torch.profiler, with their time.
On CPU (no graphs) it times the eager calls and counts no kernels: a smoke test of the script.
"""
import argparse
import collections
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import SMOLLM2_135M

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--device", default="cuda")
ap.add_argument("--tokens", type=int, default=512)
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
dev, cuda = args.device, args.device.startswith("cuda")
target = random_model(SMOLLM2_135M, torch.bfloat16, dev, seed=0)
drafter = BlockDrafterModel(BlockDrafterConfig.for_target(SMOLLM2_135M, layers=2, block_size=16)).init_weights(0)
cfg = EngineConfig(drafter=DrafterKind.BLOCK, block_size=16, max_seq_len=4096, cuda_graphs=cuda,
                   kernel_backend="triton" if cuda else "torch")
engine = build_engine(cfg, target, frozenset(), dev, block_drafter=drafter)
prompt = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(0)).tolist()
engine.warm_up(prompt, 8)
blocks = engine.drafter
sync = torch.cuda.synchronize if cuda else (lambda: None)


def ms_per_call(fn, reps: int = 200) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - t) / reps


def kernels(fn) -> dict:
    """Kernels fn launches (graph replays included) and their summed device time, by kernel name."""
    if not cuda:
        return {}
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    seen = collections.Counter()
    us = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            seen[e.name[:90]] += 1
            us[e.name[:90]] += e.device_time
    return {"count": sum(seen.values()), "device_us": round(sum(us.values()), 1),
            "by_kernel": {k: [seen[k], round(us[k], 1)] for k, _ in us.most_common()}}


engine.generate(prompt, 64)  # leaves the drafter a context to draft from; observes below rewrite its end
position = blocks.n_ctx
features = torch.randn(16, blocks.step.config.feature_dim, dtype=torch.bfloat16, device=dev)
draft = lambda: blocks.distributions(prompt[0], blocks.n_ctx, 15)  # noqa: E731


def observe(n: int):
    return lambda: blocks.observe(position, features[:n])


res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "draft_ms": ms_per_call(draft),
       "observe_ms": {n: ms_per_call(observe(n)) for n in (1, 4, 16)},
       "draft_kernels": kernels(draft), "observe_kernels": {n: kernels(observe(n)) for n in (1, 16)}}
r = engine.generate(prompt, args.tokens)
steps = r.steps
res["engine"] = {"ms_per_token": 1e3 * r.decode_s / len(r.tokens), "tokens_per_step": r.accepted_per_step,
                 "draft_ms_per_step": 1e3 * sum(s.draft_s for s in steps) / len(steps),
                 "verify_and_observe_ms_per_step": 1e3 * sum(s.verify_s for s in steps) / len(steps)}
json.dump(res, open(os.path.join(args.out, "block_drafter_step.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if not k.endswith("kernels")}, indent=1))
for name in ("draft_kernels", "observe_kernels"):
    print(name, json.dumps(res[name], indent=1)[:3000])
