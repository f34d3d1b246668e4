"""W12 on the GPU, two questions session 5's first call left open (random weights):

1. Which op parts the W12 forward from the native one? Layer 0 of a random SmolLM2 (and Llama-3-8B) shape, the
   launch parameters fused_forward uses: each native launch next to its W12 counterpart, and next to the bf16
   kernel the W12 one copies (rmsnorm_linear, linear), on the same inputs; bits compared at T = 1 and 16.
2. Where does the W12 GEMM's time go? w12_linear against linear over the T-neutral launch grid (block_n x
   num_warps), for the kernel as written and for variants with one part of the decode removed (their outputs
   are wrong; only their time says what that part costs): the kWidth reduction, the escape branch, the
   exponent-table gather.

    PYTHONPATH=. python3 scripts/gpu_w12_diag.py OUT.json
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

from specpilot.engines.config import WeightFormat
from specpilot.engines.fused import ATTENTION_ORDER, rope_tables_for  # noqa: F401
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels import linear, rmsnorm_linear, rope_kv_write, swiglu
from specpilot.kernels.bench import time_graph
from specpilot.kernels.norm_epilogues import rmsnorm_glu, rmsnorm_qkv_rope
from specpilot.kernels.w12_linear import w12_linear, w12_rmsnorm_linear
from specpilot.weights.format import encode

DEV = torch.device("cuda")


def same(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    diff = (a.view(bits) != b.view(bits))
    return "equal" if not diff.any() else f"{int(diff.sum())}/{diff.numel()} differ"


def ops_layer0(model, T: int) -> dict[str, str]:
    sh, layer = model.shape, model.layers[0]
    tabs = rope_tables_for(model, 256, DEV)
    lt, cos, sin = tabs.launch, tabs.cos, tabs.sin
    H, I, qkv_n = sh.hidden, sh.intermediate, sh.q_dim + 2 * sh.kv_dim
    drop = lambda p, *keys: {k: v for k, v in p.items() if k not in keys}  # noqa: E731 (fused_forward's W12 rule)
    p_qkv, p_rope = lt.get("qkv", qkv_n, H, T), lt.get("rope_kv", qkv_n, sh.head_dim, T)
    p_o, p_gu = lt.get("o_proj", H, sh.q_dim, T), lt.get("gate_up", 2 * I, H, T)
    p_act, p_down = lt.get("swiglu", I, 2 * I, T), lt.get("down", H, I, T)
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
    caches = lambda: [torch.zeros(sh.kv_heads, 256, sh.head_dim, dtype=torch.bfloat16, device=DEV) for _ in "kv"]  # noqa

    out = {}
    kc0, vc0 = caches()
    q_native = rmsnorm_qkv_rope(x, ln1, w_qkv, sh.rms_eps, pos, pos, cos, sin, kc0, vc0, sh.heads, sh.kv_heads, **p_qkv)
    qkv_bf16 = rmsnorm_linear(x, ln1, w_qkv, sh.rms_eps, **drop(p_qkv, "row_tile"))
    qkv_w12 = w12_rmsnorm_linear(x, ln1, q_qkv, sh.rms_eps, **drop(p_qkv, "row_tile"))
    out["qkv: rmsnorm_linear bf16 vs w12"] = same(qkv_bf16, qkv_w12)
    kc1, vc1 = caches()
    q_sep = rope_kv_write(qkv_w12, pos, pos, cos, sin, kc1, vc1, sh.heads, sh.kv_heads, **p_rope)
    out["qkv: fused rope epilogue vs w12 + rope_kv_write (q)"] = same(q_native, q_sep)
    out["qkv: ... (k cache)"] = same(kc0, kc1)
    out["qkv: ... (v cache)"] = same(vc0, vc1)
    out["o: linear vs w12_linear (o's block_k dropped)"] = same(linear(o_in, w_o, x, **p_o),
                                                              w12_linear(o_in, q_o, x, **drop(p_o, "block_k", "row_tile")))
    out["o: linear default block_k vs w12_linear"] = same(linear(o_in, w_o, x, **drop(p_o, "block_k", "row_tile")),
                                                        w12_linear(o_in, q_o, x, **drop(p_o, "block_k", "row_tile")))
    gu_bf16 = rmsnorm_linear(x, ln2, w_gu, sh.rms_eps, **drop(p_gu, "row_tile"))
    gu_w12 = w12_rmsnorm_linear(x, ln2, q_gu, sh.rms_eps, **drop(p_gu, "row_tile"))
    out["gate_up: rmsnorm_linear bf16 vs w12"] = same(gu_bf16, gu_w12)
    out["gate_up: rmsnorm_glu vs swiglu(rmsnorm_linear)"] = same(rmsnorm_glu(x, ln2, w_gu, sh.rms_eps, **p_gu),
                                                                 swiglu(gu_bf16, **p_act))
    out["down: linear vs w12_linear"] = same(linear(act_in, w_down, x, **p_down),
                                             w12_linear(act_in, q_down, x, **drop(p_down, "block_k", "row_tile")))
    logits, _ = rmsnorm_linear(x, model.norm.weight, head, sh.rms_eps, out_dtype=torch.float32, argmax=True,
                               store_y=True, **p_head)
    out["head: rmsnorm_linear(argmax) vs w12"] = same(
        logits, w12_rmsnorm_linear(x, model.norm.weight, q_head, sh.rms_eps, out_dtype=torch.float32,
                                   **drop(p_head, "row_tile")))
    return out


VARIANTS = {  # name -> (source text to find, replacement): each removes one part of the W12 decode
    "as written": [],
    "no kWidth reduction": [("    bits = tl.max(bits[:, :, None], axis=2)\n", "")],
    "no escape branch": [("if tl.max(tl.max(esc, axis=1), axis=0) > 0:", "if False:")],
    "no table gather": [("ex = tl.load(tab_ptr + tab_base + code).to(tl.int32)", "ex = code + 110")],
}
VARIANTS["none of the three"] = [r for v in list(VARIANTS.values())[1:] for r in v]


def variant_module(name: str, edits, tmp: Path):
    src = Path(sys.modules["specpilot.kernels.w12_linear"].__file__).read_text()
    src = src.replace("from ..weights", "from specpilot.weights").replace("from ._common", "from specpilot.kernels._common")
    src = src.replace("from .gemm", "from specpilot.kernels.gemm").replace("from .norm_gemm", "from specpilot.kernels.norm_gemm")
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"variant {name!r}: {old!r} not in w12_linear.py")
        src = src.replace(old, new)
    path = tmp / f"w12_{len(list(tmp.iterdir()))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gemm_times(shapes, tmp: Path) -> list[dict]:
    rows = []
    grid = list(itertools.product((16, 32, 64, 128), (4, 8)))
    mods = {name: variant_module(name, edits, tmp) for name, edits in VARIANTS.items()}
    for N, K in shapes:
        copies = max(1, min(16, -(-4 * 50_000_000 // (N * K * 2))))
        Ws = [(torch.randn(N, K, device=DEV) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        Qs = [encode(W) for W in Ws]
        x = torch.randn(1, K, device=DEV).to(torch.bfloat16)
        best = {}
        for bn, nw in grid:
            t = time_graph([lambda W=W: linear(x, W, block_n=bn, num_warps=nw) for W in Ws], 20)
            best["bf16 linear"] = min(best.get("bf16 linear", (1e9,)), (t * 1e3, bn, nw))
            for name, mod in mods.items():
                try:
                    t = time_graph([lambda Q=Q: mod.w12_linear(x, Q, block_n=bn, num_warps=nw) for Q in Qs], 20)
                except Exception as e:  # noqa: BLE001 (a launch that does not fit: reported, the sweep goes on)
                    print(f"{name} {N}x{K} bn={bn} nw={nw}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                best[name] = min(best.get(name, (1e9,)), (t * 1e3, bn, nw))
        default_bf16 = time_graph([lambda W=W: linear(x, W) for W in Ws], 20) * 1e3
        for name, (us, bn, nw) in best.items():
            rows.append({"N": N, "K": K, "variant": name, "best_us": us, "block_n": bn, "num_warps": nw,
                         "bf16_default_us": default_bf16})
        del Ws, Qs
    return rows


def forward_layers(model, T: int) -> str:
    """fused_forward native vs W12 on T prompt tokens, every layer captured: the first layer whose output differs."""
    from specpilot.engines.fused import fused_forward
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
    return (f"first differing layer {first} ({same(c0[first], c1[first])})" if first is not None else "layers equal") + \
        f"; logits {same(l0, l1)}; argmax {'equal' if torch.equal(a0, a1) else 'differs'}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,16", help="token counts of the per-op and whole-forward comparisons")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--skip-gemm", action="store_true")
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
    for case, ops in result["ops"].items():
        print(f"## {case}")
        for op, verdict in ops.items():
            print(f"  {op}: {verdict}")
    if a.skip_gemm:
        Path(a.out).write_text(json.dumps(result, indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        result["gemm"] = gemm_times(((4096, 4096), (14336, 4096), (4096, 14336)), Path(tmp))
    Path(a.out).write_text(json.dumps(result, indent=1))
    print("| N x K | variant | best us | block_n | warps | bf16 default us | bf16 best / this |")
    print("|---|---|---|---|---|---|---|")
    bf16_best = {(r["N"], r["K"]): r["best_us"] for r in result["gemm"] if r["variant"] == "bf16 linear"}
    for r in result["gemm"]:
        print(f"| {r['N']}x{r['K']} | {r['variant']} | {r['best_us']:.1f} | {r['block_n']} | {r['num_warps']} | "
              f"{r['bf16_default_us']:.1f} | {bf16_best[(r['N'], r['K'])] / r['best_us']:.2f} |")


if __name__ == "__main__":
    main()
