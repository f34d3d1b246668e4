"""Times every kernel of one decode/verify step at a model's real shapes, against its torch reference.

`bench_kernels(shape, tokens_list)` returns one dict per (kernel, T): the median time of the Triton kernel
and of its torch reference (cuBLAS for the projections), each with achieved GB/s and TFLOP/s computed from the
fewest bytes and the FLOPs the op needs (`LlamaShape.op_costs`, divided per layer; the fused kernels add the
costs of what they fuse). Times are CUDA-graph replays over rotated input copies (weights from HBM, no host
overhead: what a graph-captured engine pays). Needs a CUDA GPU; raises RuntimeError otherwise.
Run as `python -m specpilot.kernels.bench [llama3_8b|smollm2_135m] [T ...]`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..engines.shapes import LlamaShape, OpClass
from . import _common
from .accept import greedy_accept, greedy_accept_ref
from .act import swiglu, swiglu_ref
from ._common import capture_graph
from .attn import attention, attention_ref
from .gemm import _linear_kernel, linear, linear_ref, swiglu_linear, swiglu_linear_ref
from .norm_gemm import rms_norm_ref, rmsnorm_linear, rmsnorm_linear_ref
from .rope_kv import rope_kv_write, rope_kv_write_ref, rope_tables

KERNELS = ("qkv", "rope_kv", "attention", "o_proj", "gate_up", "swiglu", "down", "swiglu_down", "lm_head",
           "greedy_accept")


def l2_copies(nbytes: float, device: torch.device, most: int = 16) -> int:
    """How many copies of an input of `nbytes` a timing loop rotates so they span 4x the GPU's L2 (reads from HBM)."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(most, -(-4 * l2 // max(int(nbytes), 1))))


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"bench_kernels needs a CUDA GPU (device={device}, cuda available="
                           f"{torch.cuda.is_available()}); on CPU there is nothing to time: use the *_ref functions")
    if _common.is_interpreted(_linear_kernel):
        raise RuntimeError("bench_kernels cannot time kernels built under TRITON_INTERPRET=1; unset it before "
                           "importing specpilot.kernels")


def _costs(shape: LlamaShape, tokens: int, context: int, act_bytes: int) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of one call of each kernel: op_costs per layer, plus what each fused kernel fuses."""
    c = shape.op_costs(tokens, context, weight_bytes=float(act_bytes), act_bytes=act_bytes)
    L = shape.layers
    per = {k: (f / L, b / L) for k, (f, b) in c.items()}
    norm = (per[OpClass.NORM][0] / 2, per[OpClass.NORM][1] / 2)
    add = lambda a, b: (a[0] + b[0], a[1] + b[1])  # noqa: E731
    t, i = tokens, shape.intermediate
    return {
        "qkv": add(per[OpClass.QKV], norm), "rope_kv": per[OpClass.ROPE_KV], "attention": per[OpClass.ATTN],
        "o_proj": per[OpClass.O_PROJ], "gate_up": add(per[OpClass.GATE_UP], norm), "swiglu": per[OpClass.ACT],
        "down": per[OpClass.DOWN],
        # reads gate_up [T, 2I] instead of act [T, I]: down's bytes + T*I activations, ACT's FLOPs
        "swiglu_down": (per[OpClass.DOWN][0] + per[OpClass.ACT][0], per[OpClass.DOWN][1] + t * i * act_bytes),
        "lm_head": (c[OpClass.LM_HEAD][0] + norm[0], c[OpClass.LM_HEAD][1] + norm[1]),
        "greedy_accept": (0.0, 4.0 * tokens * 8),  # read argmax, draft, parents; write the path
    }


def _make(name: str, shape: LlamaShape, T: int, context: int, dtype: torch.dtype, dev: torch.device,
          seed: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Fresh inputs for one kernel (only what it reads) and its (kernel call, torch reference call)."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)

    h, D, H, KVH, I, eps = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads, shape.intermediate, shape.rms_eps
    F = torch.nn.functional
    if name in ("qkv", "gate_up", "lm_head"):
        n_out = {"qkv": shape.q_dim + 2 * shape.kv_dim, "gate_up": 2 * I, "lm_head": shape.vocab}[name]
        x, nw, W = rnd(T, h), (1 + rnd(h, scale=0.1).float()).to(dtype), rnd(n_out, h, scale=h ** -0.5)
        if name == "qkv":
            b = rnd(n_out) if shape.attention_bias else None
            return (lambda: rmsnorm_linear(x, nw, W, eps, bias=b),
                    lambda: rmsnorm_linear_ref(x, nw, W, eps, bias=b))
        if name == "gate_up":
            r = rnd(T, h)
            return lambda: rmsnorm_linear(x, nw, W, eps, r), lambda: rmsnorm_linear_ref(x, nw, W, eps, r)
        # the engine's torch baseline for logits: cuBLAS in bf16, then fp32
        return (lambda: rmsnorm_linear(x, nw, W, eps, out_dtype=torch.float32),
                lambda: F.linear(rms_norm_ref(x, nw, eps), W).float())
    if name in ("o_proj", "down"):
        k_in = shape.q_dim if name == "o_proj" else I
        x, W, r = rnd(T, k_in), rnd(h, k_in, scale=k_in ** -0.5), rnd(T, h)
        return lambda: linear(x, W, r), lambda: linear_ref(x, W, r)
    if name == "swiglu_down":
        gu, W, r = rnd(T, 2 * I), rnd(h, I, scale=I ** -0.5), rnd(T, h)
        return lambda: swiglu_linear(gu, W, r), lambda: swiglu_linear_ref(gu, W, r)
    if name == "swiglu":
        gu = rnd(T, 2 * I)
        return lambda: swiglu(gu), lambda: swiglu_ref(gu)
    if name in ("rope_kv", "attention"):
        S = context + T
        kc, vc = rnd(KVH, S, D), rnd(KVH, S, D)
        if name == "rope_kv":
            cos, sin = rope_tables(S, D, shape.rope_theta, dev)
            qkv = rnd(T, shape.q_dim + 2 * shape.kv_dim)
            pos = torch.arange(context, S, device=dev)
            return (lambda: rope_kv_write(qkv, pos, pos, cos, sin, kc, vc, H, KVH),
                    lambda: rope_kv_write_ref(qkv, pos, pos, cos, sin, kc, vc, H, KVH))
        q, anc = rnd(T, H, D), torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))
        return (lambda: attention(q, kc, vc, context, anc), lambda: attention_ref(q, kc, vc, context, anc))
    if name == "greedy_accept":
        tgt = torch.randint(0, 4, (T,), device=dev, generator=g)
        drf = torch.randint(0, 4, (T,), device=dev, generator=g)
        par = torch.arange(-1, T - 1, device=dev)
        return lambda: greedy_accept(tgt, drf, par), lambda: greedy_accept_ref(tgt, drf, par)
    raise ValueError(f"unknown kernel {name!r}; choose from {KERNELS}")


def time_graph(fns: list[Callable[[], Any]], reps: int) -> float:
    """Median ms per call of `fns` run back to back in one CUDA graph (no host overhead, inputs rotated)."""
    def all_fns():
        for f in fns:
            f()
    graph, _ = capture_graph(all_fns, warmups=1)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    return sorted(times)[len(times) // 2]


EAGER_REFS = ("rope_kv", "greedy_accept")  # references that sync with the host (validation, Python loops)


def _time(fns: list[Callable[[], Any]], graph: bool, reps: int, warmup_ms: int, rep_ms: int) -> float:
    """Graph replay time per call, or triton's do_bench median of the first call (host overhead included)."""
    import triton.testing

    if graph:
        return time_graph(fns, reps)
    return triton.testing.do_bench(fns[0], warmup=warmup_ms, rep=rep_ms, return_mode="median")


def bench_kernels(shape: LlamaShape, tokens_list: Sequence[int], device: str | torch.device = "cuda", *,
                  context: int = 2048, dtype: torch.dtype = torch.bfloat16, kernels: Sequence[str] | None = None,
                  reps: int = 20, warmup_ms: int = 25, rep_ms: int = 100) -> list[dict[str, Any]]:
    """One row per (kernel, T): median ms, GB/s and TFLOP/s of the kernel and of its torch reference.

    Each kernel is timed as CUDA-graph replays of several calls over distinct input copies, enough that their
    bytes exceed the L2 cache four times, so weights come from HBM as in a real forward and launch overhead is
    what a graph-captured engine pays. A reference that cannot be captured (it syncs with the host) is timed
    eagerly with triton.testing.do_bench (ref_mode "eager"). context: committed tokens the attention reads.
    """
    dev = torch.device(device)
    _require_cuda(dev)
    names = KERNELS if kernels is None else tuple(kernels)
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; choose from {KERNELS}")
    act_bytes = torch.empty((), dtype=dtype).element_size()
    rows: list[dict[str, Any]] = []
    for T in (int(t) for t in tokens_list):
        costs = _costs(shape, T, context + T, act_bytes)
        for name in names:
            flops, nbytes = costs[name]
            copies = l2_copies(nbytes, dev, most=64)
            calls = [_make(name, shape, T, context, dtype, dev, seed) for seed in range(copies)]
            ref_mode = "eager" if name in EAGER_REFS else "graph"
            ms = _time([c[0] for c in calls], True, reps, warmup_ms, rep_ms)
            ref_ms = _time([c[1] for c in calls], ref_mode == "graph", reps, warmup_ms, rep_ms)
            del calls
            rows.append({
                "kernel": name, "tokens": T, "context": context, "dtype": str(dtype).removeprefix("torch."),
                "ms": ms, "gbps": nbytes / ms / 1e6, "tflops": flops / ms / 1e9,
                "ref_ms": ref_ms, "ref_gbps": nbytes / ref_ms / 1e6, "ref_tflops": flops / ref_ms / 1e9,
                "ref_mode": ref_mode, "speedup_vs_ref": ref_ms / ms, "bytes": nbytes, "flops": flops,
                "copies": copies,
            })
    return rows


def format_kernel_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of bench_kernels' rows."""
    head = (f"{'kernel':<14}{'T':>4}{'us':>10}{'GB/s':>9}{'TFLOP/s':>9}{'ref us':>10}{'ref GB/s':>10}{'x ref':>7}"
            f"{'ref mode':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['kernel']:<14}{r['tokens']:>4}{r['ms'] * 1e3:>10.1f}{r['gbps']:>9.0f}{r['tflops']:>9.2f}"
                     f"{r['ref_ms'] * 1e3:>10.1f}{r['ref_gbps']:>10.0f}{r['speedup_vs_ref']:>7.2f}{r['ref_mode']:>9}")
    return "\n".join(lines)


format_table = format_kernel_table  # the name scripts/gpu_kernel_table.py imports


if __name__ == "__main__":  # python -m specpilot.kernels.bench [llama3_8b|smollm2_135m] [T ...]
    import sys

    from ..engines import shapes as _shapes

    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2_135m"
    toks = [int(v) for v in sys.argv[2:]] or [1, 4, 16, 64]
    print(format_kernel_table(bench_kernels(getattr(_shapes, model.upper()), toks)))
