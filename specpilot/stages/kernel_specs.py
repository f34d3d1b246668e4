"""The kernels the tuner can search: each one's launch parameters, the op classes whose time it carries, its
(N, K) at a model shape, and a builder of fixed random inputs that launches it with a given setting."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specpilot.engines.shapes import LlamaShape, OpClass
from specpilot.kernels import AcceptParams, AttentionParams, LaunchParams, LinearParams, RMSNormLinearParams

Run = Callable[[LaunchParams], Any]  # launches the kernel on fixed inputs with these params, returns its outputs


def _k():
    import specpilot.kernels as kernels  # looked up at call time: tests reload the modules under the interpreter
    return kernels


def _epilogues():
    from specpilot.kernels import norm_epilogues  # at call time, as _k
    return norm_epilogues


def _rnd(g: torch.Generator, dtype, dev, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)


# Bytes of identical weight copies a timed projection cycles through, about twice an H200's 50 MB L2. In a model
# step every layer's weights come from HBM; one copy of a 1 MB SmolLM2 projection launched back to back would sit
# in L2, and the tuner would time (and pick settings for) a regime the engine never runs in.
COLD_BYTES = 96 << 20
MAX_COPIES = 64


def _weights(g: torch.Generator, dtype, dev, n: int, k: int, w12: bool = False) -> Callable[[], Any]:
    """A W [n, k] and a source cycling through identical copies of it (on a GPU: COLD_BYTES of them); w12: the
    same bf16 values in the W12 kernels' layout, as the engine holds a weight_format=w12 build's projections."""
    w = _rnd(g, dtype, dev, n, k, scale=k ** -0.5)
    size = w.numel() * w.element_size()
    if w12:
        from specpilot.weights import encode
        from specpilot.weights.oct import oct_layout
        w = oct_layout(encode(w))
        size = w.kernel_bytes
    count = 1 if dev.type != "cuda" else max(1, min(MAX_COPIES, COLD_BYTES // size))
    return itertools.cycle([w] + [w.clone() for _ in range(count - 1)]).__next__


def _stat(x: torch.Tensor, nw: torch.Tensor, p: LaunchParams) -> dict[str, Any]:
    """A norm launch's producer statistic when its setting reads one: the segment sums its producer would store
    (and with post_scale the rows times the norm weight)."""
    if not getattr(p, "producer_stat", False):
        return {}
    from specpilot.kernels.rmsnorm import row_sumsq_ref, scaled_rows_ref
    return {"row_sumsq": row_sumsq_ref(x), **({"scaled_x": scaled_rows_ref(x, nw)} if p.post_scale else {})}


# Input builders: (shape, N, K, T, context, dtype, device, generator, w12) -> Run over fixed inputs of that call, each
# launching the kernel variant the engine's fused layers launch (tests/test_tune_kernels.py checks the match); w12:
# the projections read W12 weights (the same values: a setting's outputs equal the bf16 weights' bit for bit).
def _qkv(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g, w12: bool = False) -> Run:
    x, nw, w = _rnd(g, dtype, dev, t, k), _rnd(g, dtype, dev, k), _weights(g, dtype, dev, n, k, w12)
    kc, vc = (_rnd(g, dtype, dev, sh.kv_heads, ctx + t, sh.head_dim) for _ in range(2))
    cos, sin = _k().rope_tables(ctx + t, sh.head_dim, sh.rope_theta, dev)
    pos = torch.arange(ctx, ctx + t, device=dev)
    return lambda p: (_epilogues().rmsnorm_qkv_rope(x, nw, w(), sh.rms_eps, pos, pos, cos, sin, kc, vc, sh.heads,
                                                    sh.kv_heads, **p.as_kwargs(), **_stat(x, nw, p)), kc, vc)


def _gate_up(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g, w12: bool = False) -> Run:
    x, nw, w = _rnd(g, dtype, dev, t, k), _rnd(g, dtype, dev, k), _weights(g, dtype, dev, n, k, w12)
    return lambda p: _epilogues().rmsnorm_glu(x, nw, w(), sh.rms_eps, **p.as_kwargs(), **_stat(x, nw, p))


def _lm_head(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g, w12: bool = False) -> Run:
    # with the argmax epilogue and its combine launch, as fused_forward launches the head; the logits are kept
    # (the engine's hot path skips them) so every bit of them is still compared between settings
    x, nw, w = _rnd(g, dtype, dev, t, k), _rnd(g, dtype, dev, k), _weights(g, dtype, dev, n, k, w12)
    return lambda p: _k().rmsnorm_linear(x, nw, w(), sh.rms_eps, out_dtype=torch.float32, argmax=True,
                                         **p.as_kwargs(), **_stat(x, nw, p))


def _linear(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g, w12: bool = False) -> Run:
    x, w, r = _rnd(g, dtype, dev, t, k), _weights(g, dtype, dev, n, k, w12), _rnd(g, dtype, dev, t, n)
    return lambda p: _k().linear(x, w(), r, **p.as_kwargs())


def _attention(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g, w12: bool = False) -> Run:
    kc, vc = (_rnd(g, dtype, dev, sh.kv_heads, ctx + t, sh.head_dim) for _ in range(2))
    q, anc = _rnd(g, dtype, dev, t, sh.heads, sh.head_dim), torch.tril(torch.ones(t, t, dtype=torch.bool, device=dev))
    return lambda p: _k().attention(q, kc, vc, ctx, anc, **p.as_kwargs())


def _accept(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g, w12: bool = False) -> Run:
    tgt, drf = (torch.randint(0, 4, (t,), generator=g).to(dev) for _ in range(2))
    return lambda p: _k().greedy_accept(tgt, drf, torch.arange(-1, t - 1, device=dev), **p.as_kwargs())


@dataclass(frozen=True)
class KernelSpec:
    name: str
    params: type[LaunchParams]
    ops: tuple[OpClass, ...]  # op classes whose time this kernel carries
    dims: Callable[[LlamaShape], tuple[int, int]]  # (N, K): output and input features of one call
    make: Callable[..., Run]


_QKV = lambda s: s.q_dim + 2 * s.kv_dim  # noqa: E731
SPECS: tuple[KernelSpec, ...] = (
    KernelSpec("qkv", RMSNormLinearParams, (OpClass.QKV, OpClass.NORM), lambda s: (_QKV(s), s.hidden), _qkv),
    KernelSpec("gate_up", RMSNormLinearParams, (OpClass.GATE_UP, OpClass.NORM),
               lambda s: (2 * s.intermediate, s.hidden), _gate_up),
    KernelSpec("lm_head", RMSNormLinearParams, (OpClass.LM_HEAD,), lambda s: (s.vocab, s.hidden), _lm_head),
    KernelSpec("o_proj", LinearParams, (OpClass.O_PROJ,), lambda s: (s.hidden, s.q_dim), _linear),
    KernelSpec("down", LinearParams, (OpClass.DOWN,), lambda s: (s.hidden, s.intermediate), _linear),
    KernelSpec("attention", AttentionParams, (OpClass.ATTN,), lambda s: (s.q_dim, s.kv_dim), _attention),
    KernelSpec("greedy_accept", AcceptParams, (OpClass.ACCEPT,), lambda s: (1, 1), _accept),
)
BY_NAME = {s.name: s for s in SPECS}

PROJECTIONS = ("qkv", "gate_up", "lm_head", "o_proj", "down")


def projection_table(shape: LlamaShape, **params: Any) -> tuple[tuple[str, str], ...]:
    """Kernel-table entries giving every projection of `shape` these launch params at every T (one T=1 entry
    per kernel: its numerics-setting fields then hold for every T). QKV's block_n is capped at head_dim (its
    tiles hold rotary pairs of one head)."""
    import json

    from specpilot.kernels.table import table_key

    def own(name: str) -> dict[str, Any]:
        if name == "qkv" and params.get("block_n") is not None:
            return {**params, "block_n": min(params["block_n"], shape.head_dim)}
        return params
    return tuple((table_key(s.name, *s.dims(shape), 1), json.dumps(own(s.name))) for s in SPECS
                 if s.name in PROJECTIONS)
