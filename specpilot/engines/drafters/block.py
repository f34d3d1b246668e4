"""Block drafter model (DFlash-style): a few non-causal layers that draft B tokens in one forward.

Inputs: the block [pending token, B-1 mask slots] embedded with the target's frozen embedding, and the
target's features (outputs of a few target layers, concatenated) for every committed token. The features
are projected once (fc + RMSNorm) into the drafter's hidden size and serve as extra keys/values in every
drafter attention layer, so the block attends to all of the context and, non-causally, to itself. Block slot
j (1..B-1) predicts the token at position pending + j; the target's frozen LM head turns the drafter's
hidden states into B-1 per-position distributions. Parameter names follow the published DFlash layout
(fc, hidden_norm, layers.N.self_attn.q_proj, ..., norm) plus `mask_embed`, the B-1 mask inputs.

The module owns no cache: `context_kv` turns projected context into per-layer keys/values, which the
runtime (block_tree.BlockTreeDrafter) caches and the trainer recomputes per batch.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from specpilot.engines.llama import VARYING_LENGTH_SDPA, RMSNorm, rotate_half
from specpilot.engines.shapes import LlamaShape

# How many target layers feed the drafter by default: three, spread over the depth (DFlash uses one per
# drafter layer; three spread layers carry shallow, middle and late information for any drafter depth).
DEFAULT_FEATURE_LAYERS = 3


def default_target_layers(target_layers: int, count: int = DEFAULT_FEATURE_LAYERS) -> tuple[int, ...]:
    """`count` target layers spread from layer 1 to layer L-3 (the DFlash rule: skip the embedding-like first
    layer and the last layers, which specialise in the next token only); fewer for very shallow targets."""
    if target_layers < 1 or count < 1:
        raise ValueError(f"target_layers={target_layers}, count={count}: both must be >= 1")
    if count == 1:
        return (target_layers // 2,)
    start, end = (1, target_layers - 3) if target_layers >= 5 else (0, target_layers - 1)  # tiny targets: all
    return tuple(sorted({int(round(start + i * (end - start) / (count - 1))) for i in range(count)}))


@dataclass(frozen=True)
class BlockDrafterConfig:
    vocab: int  # the target's vocabulary (shared embedding and LM head)
    hidden: int  # equals the target's hidden size: the drafter reads its embeddings and feeds its LM head
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int  # B: block slots per forward (pending token + B-1 drafted tokens), as trained
    target_layers: tuple[int, ...]  # target layers whose outputs are the drafter's context features
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True  # per-head RMSNorm on q and k (DFlash's Qwen3-style layers)
    attention_bias: bool = False
    input_scale: float = 1.0  # DFlash input_embedding_scale: multiplies the block's input embeddings
    logit_scale: float = 1.0  # DFlash output_multiplier
    logit_softcap: float = 0.0  # DFlash final_logit_softcapping; 0 = off
    mask_token_id: int | None = None  # DFlash: mask inputs are this token's target embedding; ours: learned

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"block drafter {name}={getattr(self, name)}: must be positive")
        if not 2 <= self.block_size <= 64:
            raise ValueError(f"block drafter block_size={self.block_size}: must be in 2..64")
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}: heads must be "
                             "a multiple of kv_heads and head_dim even")
        if not self.target_layers or len(set(self.target_layers)) != len(self.target_layers) or min(self.target_layers) < 0:
            raise ValueError(f"target_layers={self.target_layers}: need distinct non-negative layer indices")

    @property
    def feature_dim(self) -> int:
        return len(self.target_layers) * self.hidden

    @classmethod
    def for_target(cls, shape: LlamaShape, layers: int = 2, block_size: int = 16, intermediate: int | None = None,
                   target_layers: tuple[int, ...] | None = None) -> "BlockDrafterConfig":
        """A drafter sized from the target: same hidden size and attention geometry, `layers` layers, a
        2 x hidden MLP by default (small: a SmolLM2-135M drafter of 2 layers stays under 16 MB in bf16)."""
        return cls(vocab=shape.vocab, hidden=shape.hidden, layers=layers, heads=shape.heads, kv_heads=shape.kv_heads,
                   head_dim=shape.head_dim, intermediate=intermediate or 2 * shape.hidden, block_size=block_size,
                   target_layers=target_layers or default_target_layers(shape.layers), rms_eps=shape.rms_eps,
                   rope_theta=shape.rope_theta)

    def check_target(self, shape: LlamaShape) -> None:
        """Raises ValueError when this drafter cannot read `shape`'s features or feed its LM head."""
        if shape.hidden != self.hidden or shape.vocab != self.vocab:
            raise ValueError(f"block drafter (hidden {self.hidden}, vocab {self.vocab}) does not fit the target "
                             f"(hidden {shape.hidden}, vocab {shape.vocab})")
        if max(self.target_layers) >= shape.layers:
            raise ValueError(f"block drafter reads target layers {list(self.target_layers)} but the target has "
                             f"{shape.layers} layers")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < shape.vocab:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target's vocabulary ({shape.vocab})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BlockDrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown block drafter config key(s): {sorted(unknown)}")
        return cls(**d)


class DraftAttention(nn.Module):
    def __init__(self, c: BlockDrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, T, H] -> keys and values [N, kv_heads, T, D], keys rotated to their positions."""
        n, t, _ = x.shape
        k = self.k_proj(x).view(n, t, self.c.kv_heads, self.c.head_dim)
        v = self.v_proj(x).view(n, t, self.c.kv_heads, self.c.head_dim)
        if self.c.qk_norm:
            k = self.k_norm(k)
        k = k * cos[:, :, None] + rotate_half(k) * sin[:, :, None]
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        n, t, _ = x.shape
        q = self.q_proj(x).view(n, t, self.c.heads, self.c.head_dim)
        if self.c.qk_norm:
            q = self.q_norm(q)
        q = (q * cos[:, :, None] + rotate_half(q) * sin[:, :, None]).transpose(1, 2)
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)
        with sdpa_kernel(VARYING_LENGTH_SDPA):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                               enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(n, t, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: BlockDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: BlockDrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.mlp = DraftMLP(c)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDrafterModel(nn.Module):
    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(c.feature_dim, c.hidden, bias=False)
        self.hidden_norm = RMSNorm(c.hidden, c.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.rms_eps)
        self.mask_embed = nn.Parameter(torch.zeros(c.block_size - 1, c.hidden))
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        # The target's generated tokens, most frequent first (drafting.token_ranking; a checkpoint's, else None):
        # where EngineConfig.drafter_head_rows restricts the LM head to the first N of them.
        self.token_ranking: torch.Tensor | None = None

    def _inv_freq(self) -> torch.Tensor:
        c = self.config
        return 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))

    def init_weights(self, seed: int, std: float = 0.02) -> "BlockDrafterModel":
        """Fresh weights: N(0, std) projections, unit norms, mask inputs at the embedding scale."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        self.inv_freq = self._inv_freq().to(self.mask_embed.device)
        return self

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] -> cos, sin [N, T, D]."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target features [N, C, feature_dim] at positions [N, C] -> per-layer keys/values [N, kvh, C, D]."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_inputs(self, first: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Embedded pending tokens [..., H] -> block inputs [..., width, H] (pending token, then mask slots)."""
        width = width or self.config.block_size
        masks = self.mask_embed[:width - 1].to(first.dtype).expand(*first.shape[:-1], width - 1, first.shape[-1])
        return torch.cat([first[..., None, :], masks], dim=-2) * self.config.input_scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Block inputs x [N, Q, H] at positions [N, Q]; ctx_kv from `context_kv`; mask [N, Q, C + Q] bool or
        None (all visible). Returns the final-normed hidden states [N, Q, H]."""
        cos, sin = self.rotary(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k.to(x.dtype), v.to(x.dtype), mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states through the target's LM head weight, with DFlash's optional scale/softcap."""
        logits = F.linear(hidden, head) * self.config.logit_scale
        if self.config.logit_softcap > 0:
            logits = torch.tanh(logits / self.config.logit_softcap) * self.config.logit_softcap
        return logits


def runtime_copy(model: BlockDrafterModel, device: torch.device, dtype: torch.dtype) -> BlockDrafterModel:
    """A private inference copy at the target's dtype and device: the caller's model (a trainer's float32 one) stays
    untouched; rotary frequencies stay float32."""
    runtime = copy.deepcopy(model).to(device=device, dtype=dtype).eval().requires_grad_(False)
    runtime.inv_freq = runtime._inv_freq().to(device)
    return runtime


def lm_head_weight(target: nn.Module) -> torch.Tensor:
    """The target's output projection (the embedding when tied)."""
    return target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight


def head_tokens(model: BlockDrafterModel, rows: int) -> torch.Tensor | None:
    """The token ids (ascending, int64, CPU) the drafter's LM head keeps at drafter_head_rows = rows: the first
    `rows` of its token ranking, topped up with the lowest unranked ids; None for rows = 0 (the whole head)."""
    vocab = model.config.vocab
    if rows == 0 or rows >= vocab:
        return None
    if model.token_ranking is None:
        raise ValueError(f"drafter_head_rows={rows} needs the drafter's token ranking (token_ranking.json beside its "
                         "weights: written by `specpilot drafter train`, or `specpilot drafter rank-tokens`)")
    kept = torch.zeros(vocab, dtype=torch.bool)
    kept[model.token_ranking[:rows]] = True
    short = rows - int(kept.sum())
    if short > 0:  # fewer tokens ranked than rows: the lowest unranked ids (BPE's earliest merges: frequent ones)
        kept[torch.nonzero(~kept).flatten()[:short]] = True
    return torch.nonzero(kept).flatten()


def drafter_head(model: BlockDrafterModel, target: nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head rows the drafter ranks at drafter_head_rows = rows and the token id of each (on the head's
    device); (the whole head, None) for rows = 0."""
    head = lm_head_weight(target)
    kept = head_tokens(model, rows)
    if kept is None:
        return head, None
    kept = kept.to(head.device)
    return head.index_select(0, kept), kept
