"""The block drafter's run-time forward, arranged for few kernel launches and bit-identical to the reference.

Inside a CUDA graph every launch costs 2-5 us whatever it computes, so a drafting step for a small target is
launch-bound. This module computes what BlockDrafterModel (the reference, which the trainer runs) computes, on
the same values with the same operations at the same shapes, so every output bit is the same; only launches that
change no value are gone:
- rotary rows, the block's mask inputs and the attention mask's key positions are precomputed once;
- rotary is x*cos + swap(x)*sin' with rotate_half's sign folded into sin' (-a*b == a*-b exactly), once over the
  q and k heads together, which the norms write side by side;
- the block's keys/values go to a tail of the cache, so attention reads the cache in place instead of a per-layer
  concatenation of all of it (same key order, same strides);
- the additive mask is built once per step, not converted from bool inside each attention call;
- RMSNorm's float product is rounded straight into the model dtype (one cast launch fewer, the same rounding).
Not done, because they change bits: one GEMM for q|k|v (or gate|up, or every layer's context k|v) rounds
differently from the separate ones at times (seen in CPU bf16 at one row; cuBLAS picks kernels by shape), and a
norm over q and k heads together reduces each row in another order on CUDA when one part has < 16 rows (ATen's
reduction block width depends on the row count).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from specpilot.engines.drafters.block import BlockDrafterModel
from specpilot.engines.llama import VARYING_LENGTH_SDPA
from specpilot.kernels import attention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """llama.RMSNorm bit for bit, optionally into `out`. The float product goes straight into an x.dtype tensor: on
    CUDA one kernel computes it in float and rounds on store, as `.to(x.dtype)` of the float result does (CPU goes
    through a float temporary: same bits, no launch to save there)."""
    xf = x.float()
    scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if x.dtype == torch.float32:
        y = xf * scale
    else:
        y = torch.mul(xf, scale, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
    return torch.mul(weight, y) if out is None else torch.mul(weight, y, out=out)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """x <- x * cos + rotate_half(x) * sin, in place; sin_signed = sin with its first half negated."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    torch.add(x * cos, swapped * sin_signed, out=x)


def check_window(window: int, name: str = "window") -> int:
    """A drafter context window: > 0 keys of the last `window` context positions only, 0 the whole context."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{name}={window!r}: must be an int >= 0 (0: the whole context)")
    return window


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


class BlockStep:
    """A BlockDrafterModel (at its run-time dtype and device) with the block drafter's cache: `project` writes
    context keys/values, `draft` runs one block forward and returns top-k tokens and probabilities."""

    def __init__(self, model: BlockDrafterModel, embed: torch.Tensor, head: torch.Tensor, capacity: int,
                 block_size: int, topk: int, triton_attention: bool | None = None, window: int = 0,
                 token_map: torch.Tensor | None = None):
        """head: the LM head's rows the drafter ranks; token_map [rows] int64: the token id of each (None: the
        whole head, row i = token i)."""
        c = self.config = model.config
        self.model, self.embed, self.head, self.topk, self.token_map = model, embed, head, topk, token_map
        self.window = check_window(window)
        self.capacity, self.width = capacity, block_size
        dev, dtype = embed.device, embed.dtype
        # Rotary rows (cos, sin') of every position a step can reach, computed as BlockDrafterModel.rotary does.
        freqs = torch.arange(capacity + block_size, device=dev).float()[:, None] * model.inv_freq.to(dev)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        sin[:, :c.head_dim // 2] = -sin[:, :c.head_dim // 2]
        self.rope = torch.stack([cos, sin], dim=1)  # [positions, 2, D]
        # [layers, k/v, kv_heads, slots, D]: context keys/values at their positions, the block's in the last
        # `block_size` slots: attention reads keys in the order [context slots, block], as the reference's cat.
        self.cache = torch.zeros(c.layers, 2, c.kv_heads, capacity + block_size, c.head_dim, dtype=dtype, device=dev)
        # A key is visible to the block iff its position < the pending position; block keys (-1) always.
        self.key_pos = torch.cat([torch.arange(capacity, device=dev), torch.full((block_size,), -1, device=dev)])
        self.mask_values = torch.tensor([0.0, float("-inf")], dtype=dtype, device=dev)  # SDPA's bool -> additive
        # Block inputs: row 0 receives the pending token's embedding each step; the mask rows never change.
        self.x = torch.zeros(block_size, c.hidden, dtype=dtype, device=dev)
        self.x[1:] = model.mask_embed[:block_size - 1].to(dtype) * c.input_scale
        # On CUDA attention runs the engine's split-key Triton kernel (kernels.attn): 16 queries over a 4112-slot
        # cache leave SDPA latency-bound on an H200 (fp32 math fallback 107 us a layer, memory-efficient kernel 210
        # us: 9 programs walk every key tile). Other bits than SDPA's: proposals only, verification decides.
        pow2_head = c.head_dim >= 16 and c.head_dim & (c.head_dim - 1) == 0  # what kernels.attention takes
        self.triton_attention = dev.type == "cuda" and pow2_head if triton_attention is None else triton_attention
        self.block_offsets = torch.arange(block_size, device=dev)
        self.block_visible = torch.ones(block_size, block_size, dtype=torch.bool, device=dev)  # non-causal block

    @torch.no_grad()
    def project(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Target features [n, feature_dim] of the tokens at `positions` ([n] long, on the device; default: the
        slots) -> their keys/values in every layer's cache at `slots` (a tree's rows sit at slots other than their
        positions until the device loop's move: EngineConfig.observe_overlap)."""
        m, c = self.model, self.config
        n = features.shape[0]
        ctx = rms_norm(linear(features.to(m.fc.weight.dtype), m.fc), m.hidden_norm.weight, c.rms_eps)
        rope = self.rope[slots if positions is None else positions]  # [n, 2, D]
        keys = torch.empty(n, c.layers, c.kv_heads, c.head_dim, dtype=ctx.dtype, device=ctx.device)
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            k = linear(ctx, a.k_proj).view(n, c.kv_heads, c.head_dim)
            if c.qk_norm:
                rms_norm(k, a.k_norm.weight, c.rms_eps, out=keys[:, i])
            else:
                keys[:, i] = k
            v = linear(ctx, a.v_proj).view(n, c.kv_heads, c.head_dim)
            self.cache[i, 1].index_copy_(1, slots, v.transpose(0, 1))
        rotate(keys, rope[:, None, None, 0], rope[:, None, None, 1])  # every layer's keys at once
        self.cache[:, 0].index_copy_(2, slots, keys.permute(1, 2, 0, 3))

    @torch.no_grad()
    def draft(self, ints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ints = (pending token, its position) on the device -> top-k tokens and probabilities [B - 1, k] of the
        block slots after the pending one. Fixed shapes (the whole cache, masked): one CUDA graph serves all."""
        m, c, width = self.model, self.config, self.width
        if c.input_scale == 1.0:  # x * 1.0 == x: the reference's multiply changes no bit
            torch.index_select(self.embed, 0, ints[:1], out=self.x[:1])
        else:
            torch.mul(self.embed[ints[:1]], c.input_scale, out=self.x[:1])
        # Rotary rows of the consecutive positions position..position+B-1: one gather of a window.
        rope = self.rope.unfold(0, width, 1)[ints[1:2]][0].permute(2, 0, 1)  # [B, 2, D]
        cos, sin = rope[:, None, 0], rope[:, None, 1]
        mask = None
        if not self.triton_attention:
            visible = self.key_pos < ints[1]
            if self.window:  # block keys (key_pos -1) stay visible
                visible = visible & ((self.key_pos >= ints[1] - self.window) | (self.key_pos < 0))
            mask = torch.where(visible.expand(width, -1), *self.mask_values)[None, None]
        x = self.x
        for i, layer in enumerate(m.layers):
            x = x + self._attention(x, layer, self.cache[i], cos, sin, mask, ints[1:2])
            h = rms_norm(x, layer.post_attention_layernorm.weight, c.rms_eps)
            x = x + linear(F.silu(linear(h, layer.mlp.gate_proj)) * linear(h, layer.mlp.up_proj), layer.mlp.down_proj)
        logits = F.linear(rms_norm(x, m.norm.weight, c.rms_eps)[1:], self.head)
        if c.logit_scale != 1.0:  # as above: a multiply by 1.0 is exact
            logits = logits * c.logit_scale
        if c.logit_softcap > 0:
            logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.topk, dim=-1)
        return top.indices if self.token_map is None else self.token_map[top.indices], top.values.exp()

    def _attention(self, x, layer, cache, cos, sin, mask, position) -> torch.Tensor:
        c, a, width, qh = self.config, layer.self_attn, self.width, self.config.heads
        h = rms_norm(x, layer.input_layernorm.weight, c.rms_eps)
        q = linear(h, a.q_proj).view(width, qh, c.head_dim)
        k = linear(h, a.k_proj).view(width, c.kv_heads, c.head_dim)
        v = linear(h, a.v_proj).view(width, c.kv_heads, c.head_dim)
        qk = torch.empty(width, qh + c.kv_heads, c.head_dim, dtype=x.dtype, device=x.device)  # q heads, then k
        if c.qk_norm:
            rms_norm(q, a.q_norm.weight, c.rms_eps, out=qk[:, :qh])
            rms_norm(k, a.k_norm.weight, c.rms_eps, out=qk[:, qh:])
        else:
            torch.cat([q, k], dim=1, out=qk)
        rotate(qk, cos, sin)
        if self.triton_attention:  # the block's keys at its own positions (past the context, rewritten by observe)
            slots = position + self.block_offsets
            cache[0].index_copy_(1, slots, qk[:, qh:].transpose(0, 1))
            cache[1].index_copy_(1, slots, v.transpose(0, 1))
            o = attention(qk[:, :qh].contiguous(), cache[0], cache[1], position, self.block_visible,
                          window=self.window)
            return linear(o, a.o_proj)
        cache[0, :, self.capacity:] = qk[:, qh:].transpose(0, 1)
        cache[1, :, self.capacity:] = v.transpose(0, 1)
        keys, values = cache[0], cache[1]
        if qh != c.kv_heads:  # GQA spelled out: with enable_gqa and a mask, an H200 ran SDPA's fp32 math fallback
            # (cuBLAS batched GEMVs, ~107 us a layer over 4112 keys); the copies cost a few us
            keys, values = (t.repeat_interleave(qh // c.kv_heads, dim=0) for t in (keys, values))
        with sdpa_kernel(VARYING_LENGTH_SDPA):
            o = F.scaled_dot_product_attention(qk[None, :, :qh].transpose(1, 2), keys[None], values[None],
                                               attn_mask=mask)
        return linear(o[0].transpose(0, 1).reshape(width, -1), a.o_proj)
