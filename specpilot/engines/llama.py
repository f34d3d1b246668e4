"""Llama-family target as a pure nn.Module: forward(ids, positions, ...) -> hidden, logits(hidden).

One sequence per call: T tokens, each with a rotary position and a KV-cache slot. Visibility is described
once for chains, trees and prefill alike: every slot below `base` is visible, and block token j (at slot
base + j) is visible to token i iff anc[i, j]. The module owns no cache; the runner passes it in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

# SDPA backends for attention whose key length changes call after call (the drafter's growing context, batched data
# generation): not cuDNN, which builds an execution plan per new length. On an H200 the block variant benched first
# on each prompt took 28-50 ms a step and those run after it, on lengths already planned, 5-11 ms (the suspected
# cause; not yet re-measured with this setting). Flash and memory-efficient kernels take any length without a plan.
VARYING_LENGTH_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

from specpilot.engines.shapes import LlamaShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm so float32 outputs match it.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def visibility_mask(base: torch.Tensor, anc: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[T, S] bool: slot s visible to token i. base: 0-dim long tensor; anc: [T, A] bool (block of width A)."""
    s = torch.arange(num_slots, device=anc.device)
    rel = s - base
    width = anc.shape[1]
    in_block = (rel >= 0) & (rel < width)
    block = anc[:, rel.clamp(0, width - 1)] & in_block
    return (s < base) | block


def position_slots(base: torch.Tensor, anc: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row keys in POSITION order: (slot_of [T, S] long, mask [T, S] bool).

    Entry s of row i is the key at position s: for s < base the slot s; for base <= s <= base + depth_i the slot
    of row i's ancestor at depth s - base (block token j sits at slot base + j); beyond, slot s, masked. A tree
    verify then reads the very keys AR reads (AR: slot == position, the identity map) in the same order and
    layout, so a node's attention is bit-identical to AR's at its position. Needs anc ancestor-or-self with
    parents before children (ancestor indices grow with depth), as every block here is built: row i's ancestor
    at depth e is then its (e+1)-th ancestor in index order, and depth_i = (ancestor count) - 1. Tensor ops
    only (CUDA-graph safe): base is a 0-dim long tensor on anc's device.
    """
    t, width = anc.shape
    anc_at, depth = _ancestor_at_depth(anc)
    s = torch.arange(num_slots, device=anc.device)
    rel = s - base
    in_blk = (rel >= 0) & (rel <= depth[:, None])  # [T, S]
    blk = anc_at.gather(1, rel.clamp(0, width - 1).expand(t, num_slots))
    slot_of = torch.where(in_blk, base + blk, s.expand(t, num_slots))
    return slot_of, (s < base) | in_blk


def ancestor_slots(base: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
    """[T, A] long: entry e of row i = slot of row i's ancestor at depth e (base + its block index), -1 past
    depth_i. The Triton attention's block_slots; same assumptions as position_slots."""
    anc_at, depth = _ancestor_at_depth(anc)
    e = torch.arange(anc.shape[1], device=anc.device)
    return torch.where(e[None, :] <= depth[:, None], base + anc_at, torch.full_like(anc_at, -1))


def _ancestor_at_depth(anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, A] block index of row i's ancestor at depth e (clamped past depth_i), [T] depth_i)."""
    t, width = anc.shape
    cum = anc.long().cumsum(1)  # [T, A]: ancestors among block tokens 0..j
    e = torch.arange(1, width + 1, device=anc.device).expand(t, width).contiguous()
    return torch.searchsorted(cum, e).clamp_(max=width - 1), cum[:, -1] - 1


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.qkv_proj = nn.Linear(shape.hidden, shape.q_dim + 2 * shape.kv_dim, bias=shape.attention_bias)
        self.o_proj = nn.Linear(shape.q_dim, shape.hidden, bias=False)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, slots, mask, slot_of=None):
        """mask: [T, S] over slots, or with slot_of [T, S] (see position_slots) over row i's keys
        k_cache[:, slot_of[i]], which are then gathered per row and attended in that (position) order."""
        sh = self.shape
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([sh.q_dim, sh.kv_dim, sh.kv_dim], dim=-1)
        q = q.view(t, sh.heads, sh.head_dim)
        k = k.view(t, sh.kv_heads, sh.head_dim)
        v = v.view(t, sh.kv_heads, sh.head_dim)
        if sh.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        k_cache.index_copy_(1, slots, k.transpose(0, 1))
        v_cache.index_copy_(1, slots, v.transpose(0, 1))
        if slot_of is not None:
            # Per-row keys in position order, batch (kv head, token) with the token's G query heads as its
            # queries: fixed shapes, so AR (identity map) and a tree verify run the same kernels. Explicit fp32
            # matmul + softmax + matmul rather than SDPA: CPU SDPA's result for a batch entry depends on its
            # index for some group sizes (seen with G = 1 and 3), these batched matmuls' did not.
            group = sh.heads // sh.kv_heads
            qg = q.view(t, sh.kv_heads, group, sh.head_dim).transpose(0, 1).float()  # [KVH, T, G, D]
            scores = torch.matmul(qg, k_cache[:, slot_of].float().transpose(-1, -2)) * sh.head_dim ** -0.5
            probs = torch.softmax(scores.masked_fill(~mask[None, :, None], float("-inf")), dim=-1)
            o = torch.matmul(probs, v_cache[:, slot_of].float()).to(q.dtype)  # [KVH, T, G, D]
            return self.o_proj(o.transpose(0, 1).reshape(t, sh.q_dim))
        # Attention over every slot at a fixed shape; invisible slots are masked to exactly zero weight.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_cache[None], v_cache[None], attn_mask=mask[None, None], enable_gqa=True)
        return self.o_proj(o[0].transpose(0, 1).reshape(t, sh.q_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.intermediate = shape.intermediate
        self.gate_up_proj = nn.Linear(shape.hidden, 2 * shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_eps)
        self.mlp = MLP(shape)

    def forward(self, x, cos, sin, k_cache, v_cache, slots, mask, slot_of=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, slots, mask, slot_of)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, shape.rms_eps)
        self.lm_head = None if shape.tie_embeddings else nn.Linear(shape.hidden, shape.vocab, bias=False)
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, ids, positions, slots, mask, k_caches, v_caches, capture: tuple[int, ...] = (), slot_of=None):
        """ids/positions/slots: [T] long; mask: [T, S] bool; k_caches/v_caches: per layer [kv_heads, S, D];
        slot_of: optional [T, S] per-row key slots in position order (position_slots), mask then over those.

        Returns the final-normed hidden states [T, hidden], and the hidden states after the layers named in
        `capture` (for drafters that read target features) when asked.
        """
        x = self.embed_tokens(ids)
        cos, sin = self.rotary(positions, x.dtype)
        captured = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_caches[i], v_caches[i], slots, mask, slot_of)
            if i in capture:
                captured.append(x)
        h = self.norm(x)
        return (h, captured) if capture else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
