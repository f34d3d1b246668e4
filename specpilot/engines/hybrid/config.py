"""Hybrid recurrent targets (Gated DeltaNet + gated attention + MoE, the Qwen3-Next layout): shape and knobs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from specpilot.engines.config import (MAX_CHECKPOINT_SPACING, ConfigError, EngineConfig, KernelBackend,
                                      VerifyMode)
from specpilot.engines.shapes import OpClass, UnsupportedModelError


class LayerKind(str, Enum):
    LINEAR = "linear_attention"  # Gated DeltaNet: causal conv1d + gated delta rule, O(1) state per sequence
    FULL = "full_attention"  # gated softmax attention with partial rotary and a KV cache


class GdnBackend(str, Enum):
    REFERENCE = "reference"  # torch (specpilot.kernels.gdn.tree_gdn_ref): CPU path and oracle
    TRITON = "triton"  # the Triton tree scan (CUDA, or TRITON_INTERPRET=1 on CPU)


@dataclass(frozen=True)
class HybridShape:
    vocab: int
    hidden: int
    layer_kinds: tuple[LayerKind, ...]
    sparse_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP
    rms_eps: float
    tie_embeddings: bool
    # gated attention layers
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # partial rotary: the first rotary_dim dims of each head rotate
    rope_theta: float
    attention_bias: bool
    # Gated DeltaNet layers
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    # MLPs
    intermediate: int  # dense MLP layers
    experts: int
    experts_per_tok: int
    moe_intermediate: int
    shared_intermediate: int
    norm_topk_prob: bool

    @property
    def layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def model_type(self) -> str:  # config.json's model_type: the model family in memory scopes
        return "qwen3_next"

    def first_layers(self, n: int) -> "HybridShape":
        """The model cut to its first n layers (kinds and MLPs as they were): per-layer cost at fewer layers."""
        if not 1 <= n <= self.layers:
            raise ValueError(f"layers={n}: must be in 1..{self.layers}")
        return dataclasses.replace(self, layer_kinds=self.layer_kinds[:n], sparse_layers=self.sparse_layers[:n])

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.LINEAR)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.FULL)

    @property
    def key_dim(self) -> int:
        return self.lin_k_heads * self.lin_k_dim

    @property
    def value_dim(self) -> int:
        return self.lin_v_heads * self.lin_v_dim

    @property
    def conv_dim(self) -> int:  # channels of the depthwise conv: q, k and v of every head
        return 2 * self.key_dim + self.value_dim

    @property
    def state_elems(self) -> int:  # one GDN layer's recurrent state [v_heads, d_k, d_v]
        return self.lin_v_heads * self.lin_k_dim * self.lin_v_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HybridShape":
        """The inverse of dataclasses.asdict (after a JSON round trip: lists for tuples, strings for kinds)."""
        return cls(**{**d, "layer_kinds": tuple(LayerKind(k) for k in d["layer_kinds"]),
                      "sparse_layers": tuple(bool(s) for s in d["sparse_layers"])})

    def op_costs(self, tokens: int, context: int, weight_bytes: float = 2.0,
                 act_bytes: int = 2) -> dict[OpClass, tuple[float, float]]:
        """(FLOPs, bytes) per op class for one forward of `tokens` rows over `context` cached keys, as
        LlamaShape.op_costs counts them (fewest bytes: each weight read once, activations once). The Gated DeltaNet
        layers' projections count as QKV and O_PROJ; their conv and recurrent scan as ATTN, whose fewest bytes are
        one read and one write of the fp32 state and the conv rows (the state-traffic floor, hybrid/cost.py). MoE
        layers read the experts `tokens` rows touch under uniform routing, E (1 - (1 - k/E)^t), plus the shared
        expert and the router (GATE_UP)."""
        t, h, wb, ab = tokens, self.hidden, weight_bytes, act_bytes
        la, lg = len(self.attn_layers), len(self.gdn_layers)
        costs: dict[OpClass, list[float]] = {op: [0.0, 0.0] for op in OpClass if op is not OpClass.OTHER}

        def add(op: OpClass, flops: float, nbytes: float, times: int = 1) -> None:
            costs[op][0] += times * flops
            costs[op][1] += times * nbytes

        def linear(op: OpClass, n_in: int, n_out: int, times: int = 1, rows: int = t, weights: float = 1.0) -> None:
            add(op, 2.0 * rows * n_in * n_out, weights * n_in * n_out * wb + rows * (n_in + n_out) * ab, times)
        q, kv, rot = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.rotary_dim
        linear(OpClass.QKV, h, 2 * q + 2 * kv, la)  # q_proj carries the output gate
        linear(OpClass.O_PROJ, q, h, la)
        add(OpClass.ATTN, 4.0 * t * context * q, 2 * context * kv * ab + 2 * t * q * ab, la)
        add(OpClass.ROPE_KV, 6.0 * t * (self.heads + self.kv_heads) * rot, t * (q + 3 * kv) * ab * 2, la)
        linear(OpClass.QKV, h, 2 * self.key_dim + 2 * self.value_dim + 2 * self.lin_v_heads, lg)
        linear(OpClass.O_PROJ, self.value_dim, h, lg)
        conv_rows = (self.conv_kernel - 1) * self.conv_dim * ab
        add(OpClass.ATTN, t * (2.0 * self.conv_kernel * self.conv_dim + 8.0 * self.state_elems),
            2 * (4 * self.state_elems + conv_rows) + t * (2 * self.conv_dim + self.value_dim) * ab, lg)
        add(OpClass.NORM, 4.0 * t * self.value_dim, 2 * t * self.value_dim * ab + self.lin_v_dim * ab, lg)
        add(OpClass.NORM, 2 * 4.0 * t * h, 2 * (2 * t * h * ab + h * ab), self.layers)
        for sparse in self.sparse_layers:
            if not sparse:
                linear(OpClass.GATE_UP, h, 2 * self.intermediate)
                add(OpClass.ACT, 4.0 * t * self.intermediate, 3 * t * self.intermediate * ab)
                linear(OpClass.DOWN, self.intermediate, h)
                continue
            e, k, mi, si = self.experts, self.experts_per_tok, self.moe_intermediate, self.shared_intermediate
            touched = e * (1.0 - (1.0 - k / e) ** t)
            linear(OpClass.GATE_UP, h, e + 1)  # router and shared-expert gate
            linear(OpClass.GATE_UP, h, 2 * mi, rows=t * k, weights=touched)
            linear(OpClass.GATE_UP, h, 2 * si)
            add(OpClass.ACT, 4.0 * t * (k * mi + si), 3 * t * (k * mi + si) * ab)
            linear(OpClass.DOWN, mi, h, rows=t * k, weights=touched)
            linear(OpClass.DOWN, si, h)
        add(OpClass.EMBED, 0.0, t * h * ab * 2)
        add(OpClass.LM_HEAD, 2.0 * t * h * self.vocab, h * self.vocab * wb + t * (h * ab + self.vocab * 4))
        add(OpClass.ACCEPT, t * self.vocab, t * self.vocab * 4)
        return {op: (f, b) for op, (f, b) in costs.items()}

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "HybridShape":
        if cfg.get("model_type") != "qwen3_next":
            raise UnsupportedModelError(f"model_type={cfg.get('model_type')!r}: the hybrid target loads qwen3_next")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg['hidden_act']!r}: only silu is supported")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
            raise UnsupportedModelError(f"rope {rope or cfg.get('rope_scaling')}: only default rope is supported")
        n = cfg["num_hidden_layers"]
        every = cfg.get("full_attention_interval", 4)
        kinds = cfg.get("layer_types") or [
            "linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        experts = cfg.get("num_experts", 0)
        step = cfg.get("decoder_sparse_step", 1)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        shape = cls(
            vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layer_kinds=tuple(LayerKind(k) for k in kinds),
            sparse_layers=tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(n)),
            rms_eps=cfg.get("rms_norm_eps", 1e-6), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            heads=cfg["num_attention_heads"], kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=head_dim, rotary_dim=int(head_dim * partial),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            attention_bias=bool(cfg.get("attention_bias", False)),
            lin_k_heads=cfg["linear_num_key_heads"], lin_v_heads=cfg["linear_num_value_heads"],
            lin_k_dim=cfg["linear_key_head_dim"], lin_v_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg["linear_conv_kernel_dim"], intermediate=cfg["intermediate_size"], experts=experts,
            experts_per_tok=cfg.get("num_experts_per_tok", 0), moe_intermediate=cfg.get("moe_intermediate_size", 0),
            shared_intermediate=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        shape.validate()
        return shape

    def validate(self) -> None:
        if len(self.sparse_layers) != self.layers:
            raise UnsupportedModelError("sparse_layers must name every layer")
        if self.heads % self.kv_heads or self.lin_v_heads % self.lin_k_heads:
            raise UnsupportedModelError("query heads must be a multiple of KV heads, value heads of key heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UnsupportedModelError(f"rotary_dim={self.rotary_dim} must be even and in 1..head_dim")
        if self.conv_kernel < 2:
            raise UnsupportedModelError(f"linear_conv_kernel_dim={self.conv_kernel} must be >= 2")
        if any(self.sparse_layers) and not 0 < self.experts_per_tok <= self.experts:
            raise UnsupportedModelError(f"num_experts_per_tok={self.experts_per_tok} must be in 1..{self.experts}")


# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: 48 layers, full attention every 4th, all MoE (512 experts, top-10).
# The layer shapes equal transformers' Qwen3NextConfig defaults, documented as that checkpoint's (a test checks);
# intermediate_size 5120 and rope_theta 1e7 (where the defaults say 5632 and 1e4) are the checkpoint's values and
# affect no recurrent-state cost.
QWEN3_NEXT_80B = HybridShape(
    vocab=151936, hidden=2048,
    layer_kinds=tuple(LayerKind.FULL if (i + 1) % 4 == 0 else LayerKind.LINEAR for i in range(48)),
    sparse_layers=(True,) * 48, rms_eps=1e-6, tie_embeddings=False,
    heads=16, kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=10_000_000.0, attention_bias=False,
    lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, conv_kernel=4,
    intermediate=5120, experts=512, experts_per_tok=10, moe_intermediate=512, shared_intermediate=512,
    norm_topk_prob=True)
# For cost on one GPU: every layer exactly the 80B's (GDN, gated attention, 512-expert MoE), its first 8 layers
# (6 GDN + 2 attention, the model's 3:1 mix); the full model's bf16 weights (~160 GB) do not fit an H200.
QWEN3_NEXT_80B_LAYERS = QWEN3_NEXT_80B.first_layers(8)
# For CPU development: the same structure (3 GDN + 1 attention, MoE with a shared expert, GQA on both kinds).
QWEN3_NEXT_TINY = HybridShape(
    vocab=512, hidden=64, layer_kinds=(LayerKind.LINEAR,) * 3 + (LayerKind.FULL,), sparse_layers=(True,) * 4,
    rms_eps=1e-6, tie_embeddings=False, heads=4, kv_heads=2, head_dim=16, rotary_dim=4, rope_theta=10_000.0,
    attention_bias=False, lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16, conv_kernel=4,
    intermediate=96, experts=8, experts_per_tok=2, moe_intermediate=32, shared_intermediate=32, norm_topk_prob=True)


@dataclass(frozen=True)
class HybridConfig:
    """The hybrid runner's knobs; deployments and the explorer turn them as EngineConfig fields (see from_engine).
    Each one keeps output exact; they trade work.

    verify_tree: verify the drafter's tree with per-branch recurrent state (True; a chain drafter's proposal grows
        leaves from its own runner-up candidates, see build.with_alternatives), or collapse it to its best
        root-to-node path and verify a chain (False): a chain never resumes a state from memory and stores fewer
        checkpoints, a tree accepts more tokens per step.
    state_checkpoint_spacing: during verify, store the recurrent state of nodes at depths s-1, 2s-1, ... (plus the
        branch points a tree needs); committing a node that is not stored replays at most s-1 updates from its
        nearest stored ancestor with the same arithmetic. 1 = store every node (commit is a copy).
    dfs_order: run a tree's rows depth-first with leaf children first (the runner permutes the block and maps
        results back), so leaves and first inner children continue from the on-chip state; off = the drafter's
        order (siblings then resume from stored parents).
    gdn_backend: which implementation runs the tree scan.
    """

    verify_tree: bool = True
    state_checkpoint_spacing: int = 1
    dfs_order: bool = True
    gdn_backend: GdnBackend = GdnBackend.REFERENCE

    def __post_init__(self) -> None:
        if not isinstance(self.gdn_backend, GdnBackend):
            try:
                object.__setattr__(self, "gdn_backend", GdnBackend(self.gdn_backend))
            except ValueError:
                raise ConfigError(f"gdn_backend={self.gdn_backend!r}: expected one of "
                                  f"{[e.value for e in GdnBackend]}") from None
        for name in ("verify_tree", "dfs_order"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a bool")
        if isinstance(self.state_checkpoint_spacing, bool) or not isinstance(self.state_checkpoint_spacing, int) \
                or not 1 <= self.state_checkpoint_spacing <= MAX_CHECKPOINT_SPACING:
            raise ConfigError(f"state_checkpoint_spacing={self.state_checkpoint_spacing!r}: must be an int in "
                              f"1..{MAX_CHECKPOINT_SPACING}")

    @classmethod
    def from_engine(cls, cfg: EngineConfig) -> "HybridConfig":
        """The knobs as an EngineConfig carries them (the explorer turns EngineConfig fields): verify=tree verifies
        trees, anything else chains; kernel_backend=triton runs the Triton scan (SpecPilot's kernels on hybrids)."""
        triton = cfg.kernel_backend is KernelBackend.TRITON
        return cls(verify_tree=cfg.verify is VerifyMode.TREE, state_checkpoint_spacing=cfg.state_checkpoint_spacing,
                   dfs_order=cfg.tree_dfs_order, gdn_backend=GdnBackend.TRITON if triton else GdnBackend.REFERENCE)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (v.value if isinstance(v := getattr(self, f.name), Enum) else v)
                for f in dataclasses.fields(self)}


def hybrid_knob_schema() -> list[dict[str, Any]]:
    """HybridConfig's fields for explorers: name, type, default, and choices or range."""
    ranges = {"verify_tree": [False, True], "state_checkpoint_spacing": [1, 2, 4, 8, 16], "dfs_order": [False, True],
              "gdn_backend": [e.value for e in GdnBackend]}
    return [{"name": f.name, "type": str(f.type),
             "default": f.default.value if isinstance(f.default, Enum) else f.default, "choices": ranges[f.name]}
            for f in dataclasses.fields(HybridConfig)]
