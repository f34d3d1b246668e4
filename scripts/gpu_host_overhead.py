"""Where the host time of a decode step goes (random SmolLM2 weights, Triton backend, CUDA graphs).

python3 scripts/gpu_host_overhead.py OUT_DIR
(a) replaying the AR graph and syncing, nothing else; (b) ModelRunner.verify of one token (staging, replay,
argmax fetch); (c) SpecEngine.generate (the whole loop). Then cProfile of (c): the top functions by own time.
"""
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np
import torch

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import SMOLLM2_135M

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
n = 512
model = random_model(SMOLLM2_135M, torch.bfloat16, "cuda", seed=0)
prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(0)).tolist() * 3
eng = build_engine(EngineConfig(drafter=DrafterKind.NONE, kernel_backend="triton", max_seq_len=2048), model,
                   frozenset(), "cuda")
eng.generate(prompt, n)
torch.cuda.synchronize()
runner = eng.target
g = runner._graphs[(1, 0)]
ev = torch.cuda.Event()


def per_step(fn, reps=300):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / reps


def replay_sync():
    g.graph.replay()
    ev.record()
    ev.synchronize()


res = {"replay_sync_ms": per_step(replay_sync)}
anc1 = np.ones((1, 1), bool)
res["runner_verify_ms"] = per_step(lambda: runner.verify(300, [5], [0], anc1))
r = eng.generate(prompt, n)
res["engine_ms_per_token"] = 1e3 * r.decode_s / n
pr = cProfile.Profile()
pr.enable()
eng.generate(prompt, 256)
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
json.dump(res, open(os.path.join(out, "host.json"), "w"), indent=1)
print(s.getvalue()[-6000:])
print(res)
