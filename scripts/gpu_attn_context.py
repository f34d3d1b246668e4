"""How the attention reduction order (split_keys:block_n) trades short against long contexts on the GPU.

Per variant: one-token attention (split + combine) at SmolLM2-135M head shapes over 30 layers' caches, CUDA-graph
timed at several context lengths; then the engine's AR ms/token over a long generation (random weights, same
kernel table for every token count). Prints a table last; JSON to OUT.

    PYTHONPATH=. python scripts/gpu_attn_context.py OUT.json [--variants 64:64,128:64,256:64] [--tokens 1900]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import SMOLLM2_135M
from specpilot.kernels import attention
from specpilot.kernels.bench import time_graph

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_profile import attention_table  # noqa: E402

CONTEXTS = (128, 512, 1024, 2048, 3072)


def attention_us(split: int, block_n: int, context: int, layers: int = 30, S: int = 4096) -> float:
    sh = SMOLLM2_135M
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = [tuple(torch.randn(sh.kv_heads, S, sh.head_dim, generator=g, device="cuda").to(torch.bfloat16)
                    for _ in range(2)) for _ in range(layers)]
    q = torch.randn(1, sh.heads, sh.head_dim, generator=g, device="cuda").to(torch.bfloat16)
    base = torch.tensor([context], device="cuda")
    anc = torch.ones(1, 1, dtype=torch.bool, device="cuda")
    fns = [lambda kc=kc, vc=vc: attention(q, kc, vc, base, anc, block_n=block_n, split_keys=split)
           for kc, vc in caches]
    return 1e3 * time_graph(fns, 50)


def engine_ms(split: int, block_n: int, tokens: int) -> float:
    sh = SMOLLM2_135M
    model = random_model(sh, torch.bfloat16, "cuda", seed=0)
    prompt = torch.randint(3, sh.vocab, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    table = attention_table(sh, split, block_n)
    eng = build_engine(EngineConfig(drafter=DrafterKind.NONE, kernel_backend="triton", max_seq_len=4096,
                                    kernel_table=table), model, frozenset(), "cuda")
    eng.warm_up(prompt, 8)
    eng.generate(prompt, tokens)
    torch.cuda.synchronize()
    r = eng.generate(prompt, tokens)
    return 1e3 * r.decode_s / tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--variants", default="64:64,128:64,256:64")
    ap.add_argument("--tokens", type=int, default=1900)
    a = ap.parse_args()
    rows = []
    for v in a.variants.split(","):
        split, block_n = map(int, v.split(":"))
        row = {"variant": v, **{f"attn_us_ctx{c}": attention_us(split, block_n, c) for c in CONTEXTS}}
        row["engine_ar_ms"] = engine_ms(split, block_n, a.tokens)
        rows.append(row)
        print(row, flush=True)
    json.dump(rows, open(a.out, "w"), indent=1)
    print("\n| split:block | " + " | ".join(f"attn us/layer @{c}" for c in CONTEXTS) + f" | AR ms/token ({a.tokens}) |")
    print("|---" * (len(CONTEXTS) + 2) + "|")
    for r in rows:
        print(f"| {r['variant']} | " + " | ".join(f"{r[f'attn_us_ctx{c}']:.1f}" for c in CONTEXTS)
              + f" | {r['engine_ar_ms']:.3f} |")


if __name__ == "__main__":
    main()
