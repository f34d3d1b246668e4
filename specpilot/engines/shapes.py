"""Model shapes read from a Hugging Face config.json, and the FLOPs and bytes of one forward per op class."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

SUPPORTED_LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class UnsupportedModelError(ValueError):
    """The model's architecture is not one SpecPilot's engine implements."""


class OpClass(str, Enum):
    EMBED = "embed"
    NORM = "norm"
    QKV = "qkv"
    ROPE_KV = "rope_kv"  # rotary embedding + KV-cache write
    ATTN = "attn"
    O_PROJ = "o_proj"
    GATE_UP = "gate_up"
    ACT = "act"  # SiLU(gate) * up
    DOWN = "down"
    LM_HEAD = "lm_head"
    ACCEPT = "accept"  # argmax + acceptance
    OTHER = "other"


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    max_positions: int = 8192
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={self.heads} is not a multiple of num_key_value_heads={self.kv_heads}")
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name}={getattr(self, name)} must be positive")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "LlamaShape":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_LLAMA_TYPES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported by the Llama-family engine (supported: {', '.join(SUPPORTED_LLAMA_TYPES)})")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope_type={rope_type!r} is not supported (only default rotary embeddings)")
        heads = cfg["num_attention_heads"]
        try:
            return cls(
                vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate=cfg["intermediate_size"], rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                max_positions=int(cfg.get("max_position_embeddings", 8192)), model_type=model_type,
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks {e.args[0]!r}") from None

    def to_hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": self.model_type, "vocab_size": self.vocab,
            "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate_size": self.intermediate,
            "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias, "max_position_embeddings": self.max_positions,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
        }

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def weight_count(self) -> int:
        per_layer = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden \
            + 3 * self.hidden * self.intermediate + 2 * self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden + head

    def step_weight_count(self) -> int:
        """The weights one decode step reads: all but an untied input embedding, of which it reads a row a token."""
        return self.weight_count() - (0 if self.tie_embeddings else self.vocab * self.hidden)

    def op_costs(self, tokens: int, context: int, weight_bytes: float = 2.0, act_bytes: int = 2) -> dict[OpClass, tuple[float, float]]:
        """(FLOPs, bytes) per op class for one forward of `tokens` tokens attending to `context` cached keys.

        Bytes are the fewest a kernel must move: each weight read once, activations read and written once,
        the KV cache read once per forward (not per token), new KV written once.
        """
        t, h, L = tokens, self.hidden, self.layers
        def linear(n_in: int, n_out: int) -> tuple[float, float]:
            return 2.0 * t * n_in * n_out, n_in * n_out * weight_bytes + t * (n_in + n_out) * act_bytes
        qkv = linear(h, self.q_dim + 2 * self.kv_dim)
        o = linear(self.q_dim, h)
        gu = linear(h, 2 * self.intermediate)
        down = linear(self.intermediate, h)
        attn_flops = 4.0 * t * context * self.q_dim
        attn_bytes = 2 * context * self.kv_dim * act_bytes + 2 * t * self.q_dim * act_bytes
        costs = {
            OpClass.EMBED: (0.0, t * h * act_bytes * 2),
            OpClass.NORM: (L * 2 * 4.0 * t * h, L * 2 * (2 * t * h * act_bytes + h * act_bytes)),
            OpClass.QKV: (L * qkv[0], L * qkv[1]),
            OpClass.ROPE_KV: (L * 6.0 * t * (self.q_dim + self.kv_dim), L * t * (self.q_dim + 3 * self.kv_dim) * act_bytes * 2),
            OpClass.ATTN: (L * attn_flops, L * attn_bytes),
            OpClass.O_PROJ: (L * o[0], L * o[1]),
            OpClass.GATE_UP: (L * gu[0], L * gu[1]),
            OpClass.ACT: (L * 4.0 * t * self.intermediate, L * 3 * t * self.intermediate * act_bytes),
            OpClass.DOWN: (L * down[0], L * down[1]),
            OpClass.LM_HEAD: (2.0 * t * h * self.vocab, h * self.vocab * weight_bytes + t * (h * act_bytes + self.vocab * 4)),
            OpClass.ACCEPT: (t * self.vocab, t * self.vocab * 4),
        }
        return costs


LLAMA3_8B = LlamaShape(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                       rms_eps=1e-5, rope_theta=500000.0, tie_embeddings=False)
SMOLLM2_135M = LlamaShape(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                          rms_eps=1e-5, rope_theta=100000.0, tie_embeddings=True)
