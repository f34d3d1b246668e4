"""Tiny random Llama models whose greedy output varies (std-0.02 weights alone repeat one token forever)."""
from __future__ import annotations

import torch

from specpilot.engines.loader import random_model
from specpilot.engines.shapes import LlamaShape

SHAPES = {
    "gqa": LlamaShape(vocab=101, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                      rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False),
    "mha_tied": LlamaShape(vocab=89, hidden=48, layers=3, heads=3, kv_heads=3, head_dim=16, intermediate=96,
                           rms_eps=1e-6, rope_theta=500.0, tie_embeddings=True),
    "mqa": LlamaShape(vocab=128, hidden=96, layers=1, heads=6, kv_heads=1, head_dim=16, intermediate=160,
                      rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False),
}


def tiny_model(shape: str = "gqa", seed: int = 0, dtype: torch.dtype = torch.float32):
    m = random_model(SHAPES[shape], dtype, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # larger weights: sharper, input-dependent logits
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(dtype) * (1.0 if "embed" in name else 0.25))
    return m


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
