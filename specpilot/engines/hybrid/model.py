"""Hybrid target (Qwen3-Next layout) as a pure nn.Module: forward(ids, positions, ...) -> hidden, logits(hidden).

Like the Llama target, one sequence per call: T rows, each with a rotary position and a KV slot; attention
layers see every slot below `base` plus their block ancestors (PackedKeys lists them in sequence order). The
Gated DeltaNet layers read and write the runner's RecurrentCache as the ScanPlan says. The module owns no
cache. Parameter names are transformers' (without the "model." prefix), so checkpoints load by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.engines.hybrid.config import HybridShape, LayerKind
from specpilot.engines.hybrid.layers import (DenseMLP, GatedAttention, GatedDeltaNet, PackedKeys, SparseMoE,
                                             ZeroCentredRMSNorm)
from specpilot.engines.hybrid.state import RecurrentCache, ScanPlan
from specpilot.engines.loader import ModelLoadError, read_safetensors


def rope_inv_freq(shape: HybridShape) -> torch.Tensor:
    r = shape.rotary_dim
    return 1.0 / (shape.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))


class HybridLayer(nn.Module):
    def __init__(self, shape: HybridShape, index: int):
        super().__init__()
        self.kind = shape.layer_kinds[index]
        self.input_layernorm = ZeroCentredRMSNorm(shape.hidden, shape.rms_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(shape.hidden, shape.rms_eps)
        if self.kind is LayerKind.LINEAR:
            self.linear_attn = GatedDeltaNet(shape)
        else:
            self.self_attn = GatedAttention(shape)
        self.mlp = SparseMoE(shape) if shape.sparse_layers[index] else DenseMLP(shape.hidden, shape.intermediate)


class HybridModel(nn.Module):
    def __init__(self, shape: HybridShape):
        super().__init__()
        shape.validate()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(HybridLayer(shape, i) for i in range(shape.layers))
        self.norm = ZeroCentredRMSNorm(shape.hidden, shape.rms_eps)
        self.lm_head = None if shape.tie_embeddings else nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(shape), persistent=False)
        # Per layer: its index among the attention layers (KV cache) or among the GDN layers (recurrent cache).
        self.cache_index = [(shape.gdn_layers if k is LayerKind.LINEAR else shape.attn_layers).index(i)
                            for i, k in enumerate(shape.layer_kinds)]

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, ids, positions, slots, keys: PackedKeys, kv: torch.Tensor, rec: RecurrentCache, plan: ScanPlan):
        """ids/positions/slots: [T] long; keys: each row's visible slots; kv [2, attention layers, kv_heads, S, D]."""
        x = self.embed_tokens(ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, c in zip(self.layers, self.cache_index):
            h = layer.input_layernorm(x)
            if layer.kind is LayerKind.LINEAR:
                h = layer.linear_attn(h, rec, c, plan)
            else:
                h = layer.self_attn(h, cos, sin, kv[0, c], kv[1, c], slots, keys)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)


def read_hybrid_shape(model_dir: Path) -> HybridShape:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        return HybridShape.from_hf_config(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"{path}: not a usable qwen3_next config ({e!r})") from None


def load_hybrid_model(model_dir: Path, dtype: torch.dtype, device: str | torch.device) -> HybridModel:
    """Loads transformers' Qwen3-Next safetensors: per-expert hub tensors (experts.{e}.gate_proj...) or fused
    in-memory ones (experts.gate_up_proj); multi-token-prediction weights (mtp.*) are not used."""
    model_dir = Path(model_dir)
    shape = read_hybrid_shape(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    tensors = {name.removeprefix("model."): t  # the multi-token-prediction head is not used here
               for name, t in read_safetensors(files, keep=lambda n: not n.startswith("mtp.")).items()}
    if shape.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    for i, sparse in enumerate(shape.sparse_layers):
        p = f"layers.{i}.mlp.experts."
        if sparse and p + "gate_up_proj" not in tensors:
            try:
                experts = [[tensors.pop(f"{p}{e}.{w}.weight") for w in ("gate_proj", "up_proj", "down_proj")]
                           for e in range(shape.experts)]
            except KeyError as e:
                raise ModelLoadError(f"{model_dir}: expert weight {e.args[0]!r} missing") from None
            tensors[p + "gate_up_proj"] = torch.stack([torch.cat(ex[:2]) for ex in experts])
            tensors[p + "down_proj"] = torch.stack([ex[2] for ex in experts])
    with torch.device("meta"):
        model = HybridModel(shape)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ModelLoadError(f"{model_dir}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, assign=True)
    model.inv_freq = rope_inv_freq(shape)  # buffers built on the meta device hold no values
    return model.to(device).eval()


def random_hybrid_model(shape: HybridShape, dtype: torch.dtype, device: str | torch.device,
                        seed: int = 0) -> HybridModel:
    """Random weights for kernels and cost (never for acceptance): projections, router and conv ~ N(0, 0.02), the
    norms at identity (zero-centred norms 0, gated norms 1), A_log and dt_bias as transformers initialises them.
    Built on the meta device and cast there, so a large shape allocates its weights once, in `dtype`."""
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    with torch.device("meta"):
        model = HybridModel(shape).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates exp(A_log) in 1..16, as transformers draws them
                p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.weight"):  # ZeroCentredRMSNorm scales by 1 + w
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_inv_freq(shape).to(device)  # a float32 buffer, like the loader's
    return model.eval().requires_grad_(False)
