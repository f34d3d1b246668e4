"""W12 projections of a Llama-family model, in the fused layout the engine's Triton forward reads.

`W12Weights` holds, per layer, the W12 encodings of qkv_proj, o_proj, gate_up_proj and down_proj, and of the LM
head (the embedding when tied). It is built once per runner: by encoding the loaded model's weights, or from a
W12 pack (Hugging Face names: q|k|v and gate|up are joined with `concat_rows`, each part keeping its table).
Either way it is checked bit for bit against the model the engine runs before it is used.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator, Mapping

import torch

from specpilot.weights.format import (W12Error, W12Stats, W12Tensor, bitwise_equal, concat_rows, decode, encode,
                                      sum_stats)
from specpilot.weights.oct import OctLayout, decode_oct, oct_layout


@dataclass(frozen=True)
class W12Layer:  # W12Tensors in W12Weights, their OctLayouts (or bf16 tensors) in OctWeights
    qkv: W12Tensor | OctLayout | torch.Tensor
    o: W12Tensor | OctLayout | torch.Tensor
    gate_up: W12Tensor | OctLayout | torch.Tensor
    down: W12Tensor | OctLayout | torch.Tensor


LAYER_FIELDS = tuple(f.name for f in fields(W12Layer))  # a layer's projections, in W12Layer's order


@dataclass(frozen=True)
class W12Weights:
    layers: tuple[W12Layer, ...]
    head: W12Tensor

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, group_rows: int | None = None) -> "W12Weights":
        """Encode a LlamaModel's projections (bf16) on their device, and check the round trip."""
        def enc(t: torch.Tensor) -> W12Tensor:
            if t.dtype != torch.bfloat16:
                raise W12Error(f"weight_format=w12 needs a bf16 model, got {t.dtype} weights")
            return encode(t, group_rows=group_rows)

        layers = tuple(W12Layer(enc(l.self_attn.qkv_proj.weight), enc(l.self_attn.o_proj.weight),
                                enc(l.mlp.gate_up_proj.weight), enc(l.mlp.down_proj.weight)) for l in model.layers)
        out = cls(layers, enc(_head(model)))
        out.check_against(model)
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, W12Tensor], layers: int, tie_embeddings: bool) -> "W12Weights":
        """From a W12 pack of a Hugging Face model directory (load_w12's result), fusing as the loader does."""
        def get(name: str) -> W12Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise W12Error(f"the W12 pack has no {name!r}") from None

        out = []
        for i in range(layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = concat_rows([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
            out.append(W12Layer(qkv, get(a + "o_proj.weight"),
                                concat_rows([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
                                get(m + "down_proj.weight")))
        return cls(tuple(out), get("model.embed_tokens.weight" if tie_embeddings else "lm_head.weight"))

    def named(self) -> Iterator[tuple[str, W12Tensor]]:
        """(module name of the LlamaModel weight, its W12 tensor) for every packed projection."""
        for i, l in enumerate(self.layers):
            yield f"layers.{i}.self_attn.qkv_proj.weight", l.qkv
            yield f"layers.{i}.self_attn.o_proj.weight", l.o
            yield f"layers.{i}.mlp.gate_up_proj.weight", l.gate_up
            yield f"layers.{i}.mlp.down_proj.weight", l.down
        yield "lm_head.weight", self.head

    def check_against(self, model: torch.nn.Module) -> None:
        """Raise W12Error unless every tensor decodes, on its device, to the model's weight bit for bit."""
        if len(self.layers) != len(model.layers):
            raise W12Error(f"W12 weights have {len(self.layers)} layers, the model {len(model.layers)}")
        for name, w in self.named():
            ref = _head(model) if name == "lm_head.weight" else model.get_parameter(name)
            if w.device != ref.device:
                raise W12Error(f"{name}: W12 tensor on {w.device}, model weight on {ref.device}")
            if not bitwise_equal(decode(w), ref):
                raise W12Error(f"{name}: the W12 tensor does not decode to the model's weight")

    def to(self, device: torch.device | str) -> "W12Weights":
        return W12Weights(tuple(W12Layer(l.qkv.to(device), l.o.to(device), l.gate_up.to(device), l.down.to(device))
                                for l in self.layers), self.head.to(device))

    @property
    def stats(self) -> W12Stats:
        return sum_stats(w.stats for _, w in self.named())

    def kernel_layouts(self) -> "OctWeights":
        """Every tensor in the kernels' layout (specpilot.weights.oct), each checked to hold the same bits; a tensor
        whose layout would read more bytes than bf16 (escapes in most cells, as SmolLM2-135M's embedding) stays
        bf16 (its decode: the same bits, the same kernels)."""
        def lay(name: str, w: W12Tensor) -> OctLayout | torch.Tensor:
            o, bits = oct_layout(w), decode(w)
            if not bitwise_equal(decode_oct(o), bits):
                raise W12Error(f"{name}: the kernel layout does not hold the W12 tensor's bits")
            return bits if o.kernel_bytes >= 2 * w.stats.numel else o

        layers = tuple(W12Layer(*(lay(f"layers.{i}.{f}", getattr(l, f)) for f in LAYER_FIELDS))
                       for i, l in enumerate(self.layers))
        return OctWeights(layers, lay("lm_head", self.head))


@dataclass(frozen=True)
class OctWeights:
    """W12Weights in the kernels' layout, what the engine's forward reads (fields as W12Layer's, each an OctLayout or,
    where that would read more than bf16, a bf16 tensor)."""
    layers: tuple[W12Layer, ...]
    head: OctLayout | torch.Tensor

    def bytes_per_weight(self) -> float:
        """Bytes the kernels read a projection weight, over every layer's projections and the head (an OctLayout's
        kernel_bytes, a tensor kept in bf16 its own): the cost model's weight_bytes for a W12 build."""
        parts = [getattr(l, f) for l in self.layers for f in LAYER_FIELDS] + [self.head]
        nbytes = sum(p.kernel_bytes if isinstance(p, OctLayout) else p.numel() * p.element_size() for p in parts)
        return nbytes / sum(p.shape[0] * p.shape[1] for p in parts)


def _head(model: torch.nn.Module) -> torch.Tensor:
    return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
