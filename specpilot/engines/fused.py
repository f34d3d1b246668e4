"""The Llama forward through SpecPilot's fused, batch-invariant Triton kernels (KernelBackend.TRITON).

Eight launches per layer instead of ~15 stock ops: norm+QKV, rotary+KV write, attention (split + combine),
o_proj+residual, norm+gate_up, SwiGLU, down+residual. Every kernel tiles tokens by a fixed BLOCK_M and reduces
in a fixed order, so a token's row is bit-identical whatever the forward's width: AR (1 token) and verify
(k tokens) agree without padding to a common shape. Same weights as the torch path (the LlamaModel's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpilot.engines.llama import LlamaModel


@dataclass
class FusedTables:
    cos: torch.Tensor  # [max_pos, D/2] fp32
    sin: torch.Tensor


def rope_tables_for(model: LlamaModel, max_positions: int, device) -> FusedTables:
    from specpilot.kernels import rope_tables
    sh = model.shape
    cos, sin = rope_tables(max_positions, sh.head_dim, sh.rope_theta, device)
    return FusedTables(cos.contiguous(), sin.contiguous())


def check_fusable(model: LlamaModel) -> None:
    sh = model.shape
    if sh.qk_norm or sh.attention_bias:
        raise ValueError(f"the Triton backend does not fuse {sh.model_type} (q/k norms or QKV biases); "
                         "use kernel_backend=torch")


def fused_forward(model: LlamaModel, tables: FusedTables, ids, positions, slots, base, anc, k_caches, v_caches,
                  capture: tuple[int, ...] = ()):
    """Same contract as LlamaModel.forward, but attention visibility is (base [1] tensor, anc [T, T]) and the
    result is the pre-norm residual stream's final norm applied inside the LM-head kernel: returns
    (logits fp32 [T, V], captured layer outputs)."""
    from specpilot.kernels import attention, linear, rmsnorm_linear, rope_kv_write, swiglu
    sh = model.shape
    stream = F.embedding(ids, model.embed_tokens.weight)
    captured = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = rmsnorm_linear(stream, layer.input_layernorm.weight, attn.qkv_proj.weight, sh.rms_eps)
        q = rope_kv_write(qkv, positions, slots, tables.cos, tables.sin, k_caches[i], v_caches[i], sh.heads, sh.kv_heads)
        o = attention(q, k_caches[i], v_caches[i], base, anc)
        stream = linear(o, attn.o_proj.weight, residual=stream)
        gate_up = rmsnorm_linear(stream, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, sh.rms_eps)
        # Separate activation: fused into the down GEMM every column tile would recompute it (5x slower at 8B).
        stream = linear(swiglu(gate_up), mlp.down_proj.weight, residual=stream)
        if i in capture:
            captured.append(stream)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    logits = rmsnorm_linear(stream, model.norm.weight, head, sh.rms_eps, out_dtype=torch.float32)
    return logits, captured
