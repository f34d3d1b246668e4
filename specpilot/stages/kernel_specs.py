"""The kernels the tuner can search: each one's launch parameters, the op classes whose time it carries, its
(N, K) at a model shape, and a builder of fixed random inputs that launches it with a given setting."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from specpilot.engines.shapes import LlamaShape, OpClass
from specpilot.kernels import (AcceptParams, AttentionParams, LaunchParams, LinearParams, RMSNormLinearParams,
                               RopeKVParams, SwigluParams)

Run = Callable[[LaunchParams], Any]  # launches the kernel on fixed inputs with these params, returns its outputs


def _k():
    import specpilot.kernels as kernels  # looked up at call time: tests reload the modules under the interpreter
    return kernels


def _rnd(g: torch.Generator, dtype, dev, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)


# Input builders: (shape, N, K, T, context, dtype, device, generator) -> Run over fixed inputs of that call.
def _norm_linear(residual: bool, logits: bool) -> Callable[..., Run]:
    def make(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g) -> Run:
        x, nw, w = _rnd(g, dtype, dev, t, k), _rnd(g, dtype, dev, k), _rnd(g, dtype, dev, n, k, scale=k ** -0.5)
        r, out = _rnd(g, dtype, dev, t, k) if residual else None, torch.float32 if logits else None
        return lambda p: _k().rmsnorm_linear(x, nw, w, sh.rms_eps, r, out_dtype=out, **p.as_kwargs())
    return make


def _linear(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g) -> Run:
    x, w, r = _rnd(g, dtype, dev, t, k), _rnd(g, dtype, dev, n, k, scale=k ** -0.5), _rnd(g, dtype, dev, t, n)
    return lambda p: _k().linear(x, w, r, **p.as_kwargs())


def _swiglu(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g) -> Run:
    gu = _rnd(g, dtype, dev, t, k)
    return lambda p: _k().swiglu(gu, **p.as_kwargs())


def _rope_kv(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g) -> Run:
    kc, vc = (_rnd(g, dtype, dev, sh.kv_heads, ctx + t, sh.head_dim) for _ in range(2))
    cos, sin = _k().rope_tables(ctx + t, sh.head_dim, sh.rope_theta, dev)
    qkv, pos = _rnd(g, dtype, dev, t, n), torch.arange(ctx, ctx + t, device=dev)
    return lambda p: (_k().rope_kv_write(qkv, pos, pos, cos, sin, kc, vc, sh.heads, sh.kv_heads, **p.as_kwargs()),
                      kc, vc)


def _attention(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g) -> Run:
    kc, vc = (_rnd(g, dtype, dev, sh.kv_heads, ctx + t, sh.head_dim) for _ in range(2))
    q, anc = _rnd(g, dtype, dev, t, sh.heads, sh.head_dim), torch.tril(torch.ones(t, t, dtype=torch.bool, device=dev))
    return lambda p: _k().attention(q, kc, vc, ctx, anc, **p.as_kwargs())


def _accept(sh: LlamaShape, n: int, k: int, t: int, ctx: int, dtype, dev, g) -> Run:
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
    KernelSpec("qkv", RMSNormLinearParams, (OpClass.QKV, OpClass.NORM), lambda s: (_QKV(s), s.hidden),
               _norm_linear(False, False)),
    KernelSpec("gate_up", RMSNormLinearParams, (OpClass.GATE_UP, OpClass.NORM),
               lambda s: (2 * s.intermediate, s.hidden), _norm_linear(True, False)),
    KernelSpec("lm_head", RMSNormLinearParams, (OpClass.LM_HEAD,), lambda s: (s.vocab, s.hidden),
               _norm_linear(False, True)),
    KernelSpec("o_proj", LinearParams, (OpClass.O_PROJ,), lambda s: (s.hidden, s.q_dim), _linear),
    KernelSpec("down", LinearParams, (OpClass.DOWN,), lambda s: (s.hidden, s.intermediate), _linear),
    KernelSpec("swiglu", SwigluParams, (OpClass.ACT,), lambda s: (s.intermediate, 2 * s.intermediate), _swiglu),
    KernelSpec("rope_kv", RopeKVParams, (OpClass.ROPE_KV,), lambda s: (_QKV(s), s.head_dim), _rope_kv),
    KernelSpec("attention", AttentionParams, (OpClass.ATTN,), lambda s: (s.q_dim, s.kv_dim), _attention),
    KernelSpec("greedy_accept", AcceptParams, (OpClass.ACCEPT,), lambda s: (1, 1), _accept),
)
BY_NAME = {s.name: s for s in SPECS}

PROJECTIONS = ("qkv", "gate_up", "lm_head", "o_proj", "down")


def projection_table(shape: LlamaShape, **params: Any) -> tuple[tuple[str, str], ...]:
    """Kernel-table entries giving every projection of `shape` these launch params at every T (one T=1 entry
    per kernel: its numerics-setting fields then hold for every T)."""
    import json

    from specpilot.kernels.table import table_key
    return tuple((table_key(s.name, *s.dims(shape), 1), json.dumps(params)) for s in SPECS if s.name in PROJECTIONS)
