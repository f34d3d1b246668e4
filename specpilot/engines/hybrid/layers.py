"""Qwen3-Next building blocks: zero-centred RMSNorm, gated attention, Gated DeltaNet, dense MLP, sparse MoE.

Parameter names follow transformers' Qwen3-Next modules, so a checkpoint's tensors load by name. Every op works
row by row on a fixed-shape block (the runner pads to its token tile), so a row's bits never depend on the
other rows: that is what makes speculative verification agree with autoregressive decoding bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.engines.hybrid.config import HybridShape
from specpilot.engines.hybrid.state import RecurrentCache, ScanPlan, run_scan


class ZeroCentredRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in fp32 then cast back (transformers' Qwen3NextRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """w * x / rms(x) * silu(z) over each value head (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(dtype)) * F.silu(gate.float())).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first cos.shape[-1] dims of each head and passes the rest through. x [T, heads, D]."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos[:, None] + rotate_half(rot) * sin[:, None], rest), dim=-1)


@dataclass(frozen=True)
class PackedKeys:
    """Per row, the KV slots it attends to, packed in sequence order: the context slots 0..base-1, then its block
    ancestors root first (itself last); the rest of the fixed width is masked. A row then reduces over its keys
    in the same lanes whether its ancestors sit at consecutive slots (autoregressive) or are scattered over a
    tree block, so tree verification agrees with autoregressive decoding bit for bit, not only token for token."""

    index: torch.Tensor  # [T, L] long, L = the cache's slot count
    visible: torch.Tensor  # [T, L] bool


class GatedAttention(nn.Module):
    """Softmax attention whose output is multiplied by sigmoid(gate); q_proj yields [query | gate] per head."""

    def __init__(self, shape: HybridShape):
        super().__init__()
        self.shape = shape
        hd, bias = shape.head_dim, shape.attention_bias
        self.q_proj = nn.Linear(shape.hidden, shape.heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(shape.heads * hd, shape.hidden, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(hd, shape.rms_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, shape.rms_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, slots, keys: PackedKeys):
        sh = self.shape
        t, hd = x.shape[0], sh.head_dim
        q, gate = self.q_proj(x).view(t, sh.heads, 2 * hd).chunk(2, dim=-1)
        q = partial_rotary(self.q_norm(q), cos, sin)
        k = partial_rotary(self.k_norm(self.k_proj(x).view(t, sh.kv_heads, hd)), cos, sin)
        v = self.v_proj(x).view(t, sh.kv_heads, hd)
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))
        # One query per row against its own packed keys (a batch of rows), at a fixed width.
        kg, vg = k_cache[:, keys.index].transpose(0, 1), v_cache[:, keys.index].transpose(0, 1)  # [T, kvh, L, D]
        o = F.scaled_dot_product_attention(q[:, :, None], kg, vg, attn_mask=keys.visible[:, None, None],
                                           enable_gqa=True)
        o = o.reshape(t, sh.heads * hd)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, sh.heads * hd)))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, shape: HybridShape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape.experts, shape.hidden))


class Experts(nn.Module):
    """Expert weights stacked as transformers stores them in memory: gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(self, shape: HybridShape):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(shape.experts, 2 * shape.moe_intermediate, shape.hidden))
        self.down_proj = nn.Parameter(torch.zeros(shape.experts, shape.hidden, shape.moe_intermediate))


class SparseMoE(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert.

    Each (token, expert) pair is one matrix-vector product on gathered weights, so a token's result does not
    depend on which other tokens picked the same expert (transformers' per-expert batching would make it depend
    on the batch). A token's experts are summed in ascending expert order, as transformers' index_add_ does.
    """

    def __init__(self, shape: HybridShape):
        super().__init__()
        self.top_k, self.norm_topk = shape.experts_per_tok, shape.norm_topk_prob
        self.inter = shape.moe_intermediate
        self.gate = Router(shape)
        self.experts = Experts(shape)
        self.shared_expert = DenseMLP(shape.hidden, shape.shared_intermediate)
        self.shared_expert_gate = nn.Linear(shape.hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        top_i, order = top_i.sort(dim=-1)
        top_p = top_p.gather(-1, order).to(x.dtype)
        xv = x[:, None, :, None]  # [T, 1, H, 1] against gathered [T, k, 2I, H]
        gate, up = torch.matmul(self.experts.gate_up_proj[top_i], xv).squeeze(-1).split(self.inter, dim=-1)
        y = torch.matmul(self.experts.down_proj[top_i], (F.silu(gate) * up)[..., None]).squeeze(-1)  # [T, k, H]
        routed = torch.zeros_like(x)
        for j in range(self.top_k):
            routed = routed + y[:, j] * top_p[:, j, None]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """transformers' Qwen3NextGatedDeltaNet over a block of rows with parents. Same math: in_proj_qkvz/in_proj_ba
    in its grouped per-key-head layout, a depthwise causal conv1d (silu) over [q | k | v], l2-normalised q and k
    (q scaled by d_k^-0.5), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule, a
    gated RMSNorm and out_proj. The conv and the rule read each row's branch (its ancestors), not the rows
    before it, so one forward verifies a whole tree."""

    def __init__(self, shape: HybridShape):
        super().__init__()
        self.shape = sh = shape
        self.conv1d = nn.Conv1d(sh.conv_dim, sh.conv_dim, sh.conv_kernel, groups=sh.conv_dim, bias=False,
                                padding=sh.conv_kernel - 1)  # holds the [C, 1, K] weight; applied per branch below
        self.in_proj_qkvz = nn.Linear(sh.hidden, 2 * sh.key_dim + 2 * sh.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(sh.hidden, 2 * sh.lin_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(sh.lin_v_heads))
        self.A_log = nn.Parameter(torch.zeros(sh.lin_v_heads))
        self.norm = GatedRMSNorm(sh.lin_v_dim, sh.rms_eps)
        self.out_proj = nn.Linear(sh.value_dim, sh.hidden, bias=False)

    def _project(self, x: torch.Tensor):
        """Split the projections as transformers' fix_query_key_value_ordering does (grouped per key head)."""
        sh = self.shape
        t, r = x.shape[0], sh.lin_v_heads // sh.lin_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, sh.lin_k_heads, 2 * sh.lin_k_dim + 2 * r * sh.lin_v_dim)
        q, k, v, z = qkvz.split([sh.lin_k_dim, sh.lin_k_dim, r * sh.lin_v_dim, r * sh.lin_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, sh.lin_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, sh.lin_v_heads, sh.lin_v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def _conv(self, mixed: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv along each row's branch: window [T, K-1, C] (oldest first), then the row."""
        w = self.conv1d.weight[:, 0, :].t()  # [K, C]
        kernel = w.shape[0]
        acc = window[:, 0] * w[0]
        for j in range(1, kernel - 1):  # fixed order, elementwise: a row's bits never depend on other rows
            acc = acc + window[:, j] * w[j]
        return F.silu(acc + mixed * w[kernel - 1])

    def forward(self, x: torch.Tensor, cache: RecurrentCache, layer: int, plan: ScanPlan) -> torch.Tensor:
        sh = self.shape
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        end = plan.offset + t
        cache.mixed[layer, plan.offset:end] = mixed
        src = torch.cat([cache.conv[layer], cache.mixed[layer, :end]], dim=0)
        conv = self._conv(mixed, src[plan.windows])
        q, k, v = conv.split([sh.key_dim, sh.key_dim, sh.value_dim], dim=-1)
        q = l2norm(q.reshape(t, sh.lin_k_heads, sh.lin_k_dim).float()) * sh.lin_k_dim ** -0.5
        k = l2norm(k.reshape(t, sh.lin_k_heads, sh.lin_k_dim).float())
        v = v.reshape(t, sh.lin_v_heads, sh.lin_v_dim).float()
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        cache.save_inputs(layer, plan.offset, k, v, g, beta)
        o = torch.zeros(t, sh.lin_v_heads, sh.lin_v_dim, dtype=torch.float32, device=x.device)
        n = plan.real
        if n:
            o[:n] = run_scan(plan.backend, q[:n].contiguous(), k[:n].contiguous(), v[:n].contiguous(),
                             g[:n].contiguous(), beta[:n].contiguous(), plan.parents, plan.hold, plan.store,
                             cache.state[layer], cache.nodes[layer], offset=plan.offset)
        y = self.norm(o.to(x.dtype).reshape(-1, sh.lin_v_dim), z.reshape(-1, sh.lin_v_dim))
        return self.out_proj(y.reshape(t, sh.value_dim))
