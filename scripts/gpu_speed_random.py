"""AR step time of the engine on the H200 at SmolLM2-135M shapes with random weights (speed does not depend on
weight values), per backend, plus AR == n-gram exactness on the Triton backend. No model transfer needed."""
import json
import sys
import time

import torch

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import SMOLLM2_135M

model = random_model(SMOLLM2_135M, torch.bfloat16, "cuda", seed=0)
g = torch.Generator().manual_seed(0)
base_prompt = torch.randint(3, 49152, (40,), generator=g).tolist()
prompt = base_prompt * 3  # repeated text: the n-gram drafter finds matches
rows = []
n = int(sys.argv[2]) if len(sys.argv) > 2 else 512
for name, cfg in (("triton_graph_ar", EngineConfig(drafter=DrafterKind.NONE, kernel_backend="triton")),
                  ("torch_graph_tile16_ar", EngineConfig(drafter=DrafterKind.NONE)),
                  ("triton_graph_ngram5", EngineConfig(drafter=DrafterKind.NGRAM, kernel_backend="triton"))):
    t0 = time.time()
    eng = build_engine(cfg, model, frozenset(), "cuda")
    eng.generate(prompt, 32)
    torch.cuda.synchronize()
    r = eng.generate(prompt, n)
    torch.cuda.synchronize()
    rows.append({"mode": name, "tok_s": n / r.decode_s, "ms_per_tok": 1e3 * r.decode_s / n,
                 "tokens_per_step": r.accepted_per_step, "tokens": r.tokens, "setup_s": time.time() - t0})
    print({k: v for k, v in rows[-1].items() if k != "tokens"}, flush=True)
equal = rows[0]["tokens"] == rows[2]["tokens"]
json.dump([{k: v for k, v in r.items() if k != "tokens"} | {"equal_ar": equal} for r in rows], open(sys.argv[1], "w"), indent=1)
print("| mode | tok/s | ms/token | tokens/step |\n|---|---|---|---|")
for r in rows:
    print(f"| {r['mode']} | {r['tok_s']:.0f} | {r['ms_per_tok']:.3f} | {r['tokens_per_step']:.2f} |")
print("triton AR == triton ngram:", equal)
