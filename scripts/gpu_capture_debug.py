"""Which CUDA-graph capture mode the Triton backend survives, and its AR speed (random SmolLM2 shapes)."""
import traceback

import torch

import specpilot.kernels._common as runner_mod  # capture_graph reads CAPTURE_ERROR_MODE from here at call time
from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import SMOLLM2_135M

model = random_model(SMOLLM2_135M, torch.bfloat16, "cuda", seed=0)
prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(0)).tolist() * 3
n = 256
eng = build_engine(EngineConfig(drafter=DrafterKind.NONE, kernel_backend="triton", cuda_graphs=False), model, frozenset(), "cuda")
eng.generate(prompt, 8); torch.cuda.synchronize()
r = eng.generate(prompt, n); torch.cuda.synchronize()
print(f"triton eager: {n / r.decode_s:.0f} tok/s", flush=True)
ref = r.tokens
for mode in ("thread_local", "relaxed", "global"):
    runner_mod.CAPTURE_ERROR_MODE = mode
    try:
        eng = build_engine(EngineConfig(drafter=DrafterKind.NONE, kernel_backend="triton"), model, frozenset(), "cuda")
        eng.generate(prompt, 8); torch.cuda.synchronize()
        r = eng.generate(prompt, n); torch.cuda.synchronize()
        sp = build_engine(EngineConfig(drafter=DrafterKind.NGRAM, kernel_backend="triton"), model, frozenset(), "cuda")
        sp.generate(prompt, 8); torch.cuda.synchronize()
        rs = sp.generate(prompt, n); torch.cuda.synchronize()
        print(f"| {mode} | AR {n / r.decode_s:.0f} tok/s {1e3 * r.decode_s / n:.3f} ms | ngram {n / rs.decode_s:.0f} tok/s "
              f"{rs.accepted_per_step:.2f} tok/step | eager==graph {r.tokens == ref} | AR==ngram {r.tokens == rs.tokens} |", flush=True)
        break
    except Exception:
        print(f"mode {mode} failed:")
        traceback.print_exc(limit=-6)
        torch.cuda.synchronize()
