"""GPU check: the norm + projection kernels give the same bits with every T-neutral latency setting
(stat_unroll, act_prefetch, prenorm), and `linear` with early_residual and w_preload, at the SmolLM2 and Llama-3-8B shapes,
T = 1, 5, 16 (the CPU tests run small shapes).

python3 scripts/gpu_norm_bits.py
"""
from __future__ import annotations

import itertools

import torch

from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels.gemm import linear
from specpilot.kernels.norm_epilogues import rmsnorm_glu, rmsnorm_qkv_rope
from specpilot.kernels.norm_gemm import rmsnorm_linear
from specpilot.kernels.rope_kv import rope_tables


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    checked = 0
    for s in (SMOLLM2_135M, LLAMA3_8B):
        h, n_qkv = s.hidden, s.q_dim + 2 * s.kv_dim
        Wq = (torch.randn(n_qkv, h, generator=g, device=dev) * h ** -0.5).to(torch.bfloat16)
        Wg = (torch.randn(2 * s.intermediate, h, generator=g, device=dev) * h ** -0.5).to(torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(torch.bfloat16)
        cos, sin = rope_tables(512, s.head_dim, s.rope_theta, dev)
        for T in (1, 5, 16):
            x = torch.randn(T, h, generator=g, device=dev).to(torch.bfloat16)
            r = torch.randn(T, h, generator=g, device=dev).to(torch.bfloat16)
            pos = torch.arange(7, 7 + T, device=dev)

            def run(**kw):
                kc = torch.zeros(s.kv_heads, 512, s.head_dim, device=dev, dtype=torch.bfloat16)
                vc = torch.zeros_like(kc)
                q = rmsnorm_qkv_rope(x, nw, Wq, s.rms_eps, pos, pos, cos, sin, kc, vc, s.heads, s.kv_heads, **kw)
                act, hh = rmsnorm_glu(x, nw, Wg, s.rms_eps, r, **kw)
                y = rmsnorm_linear(x, nw, Wq, s.rms_eps, **kw)
                return [t.view(torch.int16) for t in (q, kc, vc, act, hh, y)]

            base = run()
            for unroll, pf in itertools.product((1, 2, 4, 8), (0, 1, 2)):
                got = run(stat_unroll=unroll, act_prefetch=pf)
                assert all(torch.equal(a, b) for a, b in zip(got, base)), (s, T, unroll, pf)
                checked += 1
            # the norm as a launch of its own (rmsnorm.rms_norm_rows): the fused kernels' bits, whatever the tile
            for kw in ({}, {"row_tile": 1}, {"block_k": 256, "num_warps": 8}, {"split_k": 2}, {"stat_unroll": 2}):
                got, want = run(prenorm=True, **kw), run(**kw)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (s, T, "prenorm", kw)
                checked += 1
            Wo = (torch.randn(h, s.intermediate, generator=g, device=dev) * s.intermediate ** -0.5).to(torch.bfloat16)
            a = torch.randn(T, s.intermediate, generator=g, device=dev).to(torch.bfloat16)
            bias = torch.randn(h, generator=g, device=dev).to(torch.bfloat16)
            for split in (1, 2, 4):
                want = linear(a, Wo, r, bias=bias, split_k=split).view(torch.int16)
                assert torch.equal(linear(a, Wo, r, bias=bias, split_k=split, early_residual=True).view(torch.int16),
                                   want), (s, T, split)
                checked += 1
            for kw in ({}, {"num_warps": 8}, {"block_n": 32}):
                want = linear(a, Wo, r, bias=bias, **kw).view(torch.int16)
                got = linear(a, Wo, r, bias=bias, w_preload=True, **kw).view(torch.int16)
                assert torch.equal(got, want), (s, T, kw)
                checked += 1
    print(f"{checked} latency settings equal to the defaults, bit for bit")


if __name__ == "__main__":
    main()
