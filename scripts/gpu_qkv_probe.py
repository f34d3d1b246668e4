"""Experiment (GPU): where the Llama-3-8B QKV launch loses its time (31 us a layer for 50 MB, vs ~18 for a plain GEMM).

Times, as CUDA-graph replays over weight copies that exceed L2 (kernels/bench.time_graph), at T=1 and 16:
linear (no norm), rmsnorm_linear (the norm prologue, plain epilogue) and rmsnorm_qkv_rope (norm + rotation pairs +
KV-cache writes), each over a small sweep of launch settings; prints each one's default and best.

python3 scripts/gpu_qkv_probe.py OUT.json [--budget-s 240]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
import triton.language as tl

from specpilot.engines.shapes import LLAMA3_8B
from specpilot.kernels.bench import time_graph
from specpilot.kernels.gemm import linear
from specpilot.kernels.norm_epilogues import rmsnorm_glu, rmsnorm_qkv_rope
from specpilot.kernels.norm_gemm import rmsnorm_linear
from specpilot.kernels.rope_kv import rope_tables


@triton.jit
def _row_norm_kernel(x_ptr, nw_ptr, n_ptr, K, eps, BLOCK_K: tl.constexpr):
    """n = round(nw * round(x * rstd)) for one row per program (the statistic's order here is not the fused one's)."""
    row = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        h = tl.load(x_ptr + row * K + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
        sq += h * h
    rstd = 1.0 / tl.sqrt_rn(tl.sum(sq, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK_K):
        m = k0 + ks < K
        h = tl.load(x_ptr + row * K + k0 + ks, mask=m, other=0.0)
        nw = tl.load(nw_ptr + k0 + ks, mask=m, other=0.0).to(tl.float32)
        hn = (h.to(tl.float32) * rstd).to(h.dtype)
        tl.store(n_ptr + row * K + k0 + ks, (hn.to(tl.float32) * nw).to(h.dtype), mask=m)


def row_norm(x, nw, out):
    _row_norm_kernel[(x.shape[0],)](x, nw, out, x.shape[1], 1e-5, BLOCK_K=1024, num_warps=4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--tokens", default="1,16")
    a = ap.parse_args()
    dev = torch.device("cuda")
    s = LLAMA3_8B
    h, H, KVH, D = s.hidden, s.heads, s.kv_heads, s.head_dim
    n_qkv = s.q_dim + 2 * s.kv_dim
    g = torch.Generator(device=dev).manual_seed(0)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    copies = max(1, -(-4 * l2 // (n_qkv * h * 2)))
    Ws = [(torch.randn(n_qkv, h, generator=g, device=dev) * h ** -0.5).to(torch.bfloat16) for _ in range(copies)]
    Wgu = [(torch.randn(2 * s.intermediate, h, generator=g, device=dev) * h ** -0.5).to(torch.bfloat16)
           for _ in range(2)]
    nw = torch.ones(h, device=dev, dtype=torch.bfloat16)
    S = 4096
    cos, sin = rope_tables(S, D, s.rope_theta, dev)
    kc = torch.zeros(KVH, S, D, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    sweep = {"block_n": (None, 32, 64, 128), "num_warps": (4, 8), "split_k": (1, 2, 4), "block_k": (128, 256)}
    rows, t0 = [], time.time()
    for T in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(T, h, generator=g, device=dev).to(torch.bfloat16)
        pos = torch.arange(100, 100 + T, device=dev)

        def call(kind, W, **kw):
            if kind == "linear":
                return lambda: linear(x, W, **kw)
            if kind == "norm_linear":
                return lambda: rmsnorm_linear(x, nw, W, 1e-5, **kw)
            if kind == "gate_up":
                return lambda: rmsnorm_glu(x, nw, W, 1e-5, **kw)
            return lambda: rmsnorm_qkv_rope(x, nw, W, 1e-5, pos, pos, cos, sin, kc, vc, H, KVH, **kw)

        # fixed cost of the fused norm: one program (64 W rows), fused vs plain; and norm launch + plain GEMM
        W64 = [W[:64].contiguous() for W in Ws]
        nbuf = torch.empty_like(x)
        qkv_out = torch.empty(T, n_qkv, device=dev, dtype=torch.bfloat16)
        from specpilot.kernels.rope_kv import rope_kv_write
        probes = {
            "one_program_linear": [lambda W=W: linear(x, W, block_n=64) for W in W64],
            "one_program_norm_linear": [lambda W=W: rmsnorm_linear(x, nw, W, 1e-5, block_n=64) for W in W64],
            "row_norm_only": [lambda: row_norm(x, nw, nbuf)] * len(Ws),
            "row_norm+linear": [lambda W=W: linear(row_norm(x, nw, nbuf), W) for W in Ws],
            "row_norm+linear+rope_kv": [lambda W=W: rope_kv_write(linear(row_norm(x, nw, nbuf), W, out=qkv_out), pos,
                                                                  pos, cos, sin, kc, vc, H, KVH) for W in Ws],
        }
        for label, fns in probes.items():
            us = time_graph(fns, 15) * 1e3
            rows.append({"T": T, "kind": label, "us": us})
            print(f"T={T:<3} {label:<26} {us:7.1f} us", flush=True)
        for kind in ("linear", "norm_linear", "qkv_rope", "gate_up"):
            weights = Wgu if kind == "gate_up" else Ws
            best = default = None
            for bn, warps, split, bk in itertools.product(*sweep.values()):
                if time.time() - t0 > a.budget_s:
                    break
                kw = {"block_n": bn, "num_warps": warps, "split_k": split, "block_k": bk}
                is_default = bn is None and split == 1 and bk == 128 and warps == (4 if kind == "linear" else 8)
                if kind == "gate_up" and not (is_default or (split in (1, 2) and bk == 128)):
                    continue
                try:
                    us = time_graph([call(kind, W, **kw) for W in weights], 15) * 1e3
                except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                    rows.append({"T": T, "kind": kind, **kw, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                    continue
                row = {"T": T, "kind": kind, **kw, "us": us, "gbps": weights[0].numel() * 2 / us / 1e3}
                rows.append(row)
                best = row if best is None or us < best["us"] else best
                default = row if is_default else default
            for label, r in (("default", default), ("best", best)):
                if r:
                    print(f"T={T:<3} {kind:<12} {label:<8} {r['us']:7.1f} us {r['gbps']:6.0f} GB/s  bn={r['block_n']} "
                          f"warps={r['num_warps']} split={r['split_k']} bk={r['block_k']}", flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
