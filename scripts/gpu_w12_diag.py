"""W12 against bf16 on the GPU, op by op and through the whole fused forward (random weights).

Layer 0 of a random SmolLM2 and Llama-3-8B shape, with the launch parameters fused_forward uses: each projection
launch on W12 weights next to the same launch on the bf16 weights (one kernel body: only the W tile load differs),
and the fused QKV rotary epilogue next to rmsnorm_linear + rope_kv_write (whose bits it promises); then
fused_forward native vs W12 with every layer captured: the first layer that differs. Bits compared at each T.
(Session 5 also timed variants of the W12 decode, each with one part removed: notes/h200-s5-w12-breakdown.txt.)

    PYTHONPATH=. python3 scripts/gpu_w12_diag.py OUT.json [--tokens 1,16,40,120] [--shapes smollm2,llama8b]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specpilot.engines.config import WeightFormat
from specpilot.engines.fused import fused_forward, rope_tables_for
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels import linear, rmsnorm_linear, rope_kv_write, swiglu
from specpilot.kernels.norm_epilogues import rmsnorm_glu, rmsnorm_qkv_rope
from specpilot.weights.format import encode

DEV = torch.device("cuda")


def same(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    diff = (a.view(bits) != b.view(bits))
    return "equal" if not diff.any() else f"{int(diff.sum())}/{diff.numel()} differ"


def ops_layer0(model, T: int) -> dict[str, str]:
    sh, layer = model.shape, model.layers[0]
    tabs = rope_tables_for(model, 256, DEV)
    lt, cos, sin = tabs.launch, tabs.cos, tabs.sin
    H, I, qkv_n = sh.hidden, sh.intermediate, sh.q_dim + 2 * sh.kv_dim
    p_qkv, p_o = lt.get("qkv", qkv_n, H, T), lt.get("o_proj", H, sh.q_dim, T)
    p_gu, p_down = lt.get("gate_up", 2 * I, H, T), lt.get("down", H, I, T)
    p_head = lt.get("lm_head", sh.vocab, H, T)
    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, H, generator=g, device=DEV).to(torch.bfloat16)
    o_in = torch.randn(T, sh.q_dim, generator=g, device=DEV).to(torch.bfloat16)
    act_in = torch.randn(T, I, generator=g, device=DEV).to(torch.bfloat16) * 0.1
    pos = torch.arange(5, 5 + T, device=DEV)
    ln1, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
    w_qkv, w_o = layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight
    w_gu, w_down = layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    q_qkv, q_o, q_gu, q_down, q_head = (encode(w) for w in (w_qkv, w_o, w_gu, w_down, head))

    def qkv(w):  # q, k cache, v cache of the fused QKV + rotary + cache-write launch
        kc, vc = (torch.zeros(sh.kv_heads, 256, sh.head_dim, dtype=torch.bfloat16, device=DEV) for _ in "kv")
        return rmsnorm_qkv_rope(x, ln1, w, sh.rms_eps, pos, pos, cos, sin, kc, vc, sh.heads, sh.kv_heads, **p_qkv), kc, vc

    out = {}
    native = qkv(w_qkv)
    out["qkv+rope: bf16 vs W12 (q, k, v)"] = ", ".join(same(a, b) for a, b in zip(native, qkv(q_qkv)))
    kc, vc = (torch.zeros_like(native[1]) for _ in "kv")
    q_sep = rope_kv_write(rmsnorm_linear(x, ln1, w_qkv, sh.rms_eps, **p_qkv), pos, pos, cos, sin, kc, vc,
                          sh.heads, sh.kv_heads)
    out["qkv: rotary epilogue vs rmsnorm_linear + rope_kv_write (q, k)"] = f"{same(native[0], q_sep)}, {same(native[1], kc)}"
    out["o: bf16 vs W12"] = same(linear(o_in, w_o, x, **p_o), linear(o_in, q_o, x, **p_o))
    glu = rmsnorm_glu(x, ln2, w_gu, sh.rms_eps, **p_gu)
    out["gate_up+glu: bf16 vs W12"] = same(glu, rmsnorm_glu(x, ln2, q_gu, sh.rms_eps, **p_gu))
    out["gate_up: rmsnorm_glu vs swiglu(rmsnorm_linear)"] = same(
        glu, swiglu(rmsnorm_linear(x, ln2, w_gu, sh.rms_eps, **p_gu)))
    out["down: bf16 vs W12"] = same(linear(act_in, w_down, x, **p_down), linear(act_in, q_down, x, **p_down))
    (l0, a0), (l1, a1) = (rmsnorm_linear(x, model.norm.weight, w, sh.rms_eps, out_dtype=torch.float32, argmax=True,
                                         **p_head) for w in (head, q_head))
    out["head (logits, argmax): bf16 vs W12"] = f"{same(l0, l1)}, {same(a0, a1)}"
    return out


def forward_layers(model, T: int) -> str:
    """fused_forward native vs W12 on T prompt tokens, every layer captured: the first layer whose output differs."""
    sh = model.shape
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, sh.vocab, (T,), generator=g).to(DEV)
    pos = torch.arange(T, device=DEV)
    anc = torch.tril(torch.ones(T, T, dtype=torch.bool, device=DEV))
    outs = []
    for fmt in (WeightFormat.NATIVE, WeightFormat.W12):
        kv = torch.zeros(2, sh.layers, sh.kv_heads, 256, sh.head_dim, dtype=torch.bfloat16, device=DEV)
        outs.append(fused_forward(model, rope_tables_for(model, 256, DEV, fmt), ids, pos, pos,
                                  torch.zeros(1, dtype=torch.long, device=DEV), anc, kv[0], kv[1],
                                  capture=tuple(range(sh.layers))))
    (l0, a0, c0), (l1, a1, c1) = outs
    first = next((i for i, (x, y) in enumerate(zip(c0, c1)) if same(x, y) != "equal"), None)
    return (f"first differing layer {first} ({same(c0[first], c1[first])})" if first is not None else "layers equal") \
        + f"; logits {same(l0, l1)}; argmax {same(a0, a1)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,16", help="token counts of the per-op and whole-forward comparisons")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    a = ap.parse_args()
    result = {"ops": {}, "forward": {}}
    for label, shape in (("smollm2", SMOLLM2_135M), ("llama8b", LLAMA3_8B)):
        if label not in a.shapes.split(","):
            continue
        model = random_model(shape, torch.bfloat16, DEV, seed=0)
        for T in map(int, a.tokens.split(",")):
            result["ops"][f"{label} T={T}"] = ops_layer0(model, T)
            result["forward"][f"{label} T={T}"] = forward_layers(model, T)
            print(f"forward {label} T={T}: {result['forward'][f'{label} T={T}']}", flush=True)
        del model
    Path(a.out).write_text(json.dumps(result, indent=1))
    for case, ops in result["ops"].items():
        print(f"## {case}")
        for op, verdict in ops.items():
            print(f"  {op}: {verdict}")


if __name__ == "__main__":
    main()
