"""EngineConfig: every knob a mechanism can turn, in one frozen, validated dataclass."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar


MAX_CHECKPOINT_SPACING = 64  # a deeper spacing than any verify block is "store branch points only"


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


class DrafterKind(str, Enum):
    NONE = "none"  # plain autoregressive decoding
    NGRAM = "ngram"  # suffix lookup over prompt + output (training-free)
    DRAFT_MODEL = "draft_model"  # a smaller model sharing the tokenizer
    BLOCK = "block"  # parallel block drafter (DFlash-style)


class VerifyMode(str, Enum):
    CHAIN = "chain"
    TREE = "tree"
    TWO_LEVEL = "two_level"


class LevelOneRule(str, Enum):
    """Two-level verification's cheap first level (the full target still decides: lossless either way)."""
    CONFIDENCE = "confidence"  # path-probability cut: free, uses only the drafter's scores
    SHALLOW = "shallow"  # the target's first layers vote on one path; costs a fraction of a target forward


# The most nodes a tree grown on the device holds (engines.tree_grow: a row's ancestors are two 64-bit masks).
MAX_GROWN_NODES = 127
# A switched deep step that verifies a chain (deep_tree_chain) grows nothing: it and its lookup may go this deep.
MAX_CHAIN_NODES = 255


class DeviceTree(str, Enum):
    """How the device loop shapes a block drafter's tree (engines.device_loop)."""
    CALIBRATED = "calibrated"  # one static shape from the mean probabilities of the first host-loop steps
    PER_STEP = "per_step"  # the best-first tree of each step's candidates, grown on the device (one launch a step)


class DrafterLaunches(str, Enum):
    """The block drafter's fused step's projection launches (engines.drafters.block_fused.DraftLaunches)."""
    TUNED = "tuned"  # the settings swept best at the shipped drafter's shapes (an H100, session 46)
    DEFAULT = "default"  # every projection at its kernel wrapper's defaults


class DrafterTopk(str, Enum):
    """Where the block drafter's fused step finds its head's top-k (kernels.topk): the draft's last two launches."""
    CHUNKS = "chunks"  # the head stores its logits; one launch ranks each 1024-logit chunk, one merges a row's
    HEAD = "head"  # the head's epilogue ranks each of its column tiles (no logits stored, one launch fewer)


class WeightFormat(str, Enum):
    NATIVE = "native"  # the model's compute dtype (bf16 on GPU)
    W12 = "w12"  # lossless 12-bit: 8 bits sign+mantissa, 4-bit exponent code


class KernelBackend(str, Enum):
    TORCH = "torch"  # stock torch ops (cuBLAS / CPU BLAS); the reference
    TRITON = "triton"  # SpecPilot's fused Triton kernels


class DType(str, Enum):
    BF16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"

    @property
    def torch(self):
        import torch

        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.value]


class ConfigOps:
    """replace / to_dict / from_dict / digest of a frozen config dataclass (EngineConfig, BatchConfig): unknown
    fields are refused by name; enums serialise to their values and PAIR_FIELDS (tuples of pairs) to lists."""

    PAIR_FIELDS: ClassVar[tuple[str, ...]] = ()

    def _coerce_enums(self, fields: tuple[tuple[str, type], ...]) -> None:
        """Accept each enum field as its value (YAML, JSON), converted in place on the frozen instance."""
        for name, enum in fields:
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    object.__setattr__(self, name, enum(value))
                except ValueError:
                    raise ConfigError(f"{name}={value!r}: expected one of {[e.value for e in enum]}") from None

    def replace(self, **delta: Any):
        _refuse_unknown(type(self), delta)
        return dataclasses.replace(self, **delta)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, Enum) else ([list(p) for p in v] if f.name in self.PAIR_FIELDS else v)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        _refuse_unknown(cls, d)
        return cls(**d)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _refuse_unknown(cls: type, names) -> None:
    unknown = set(names) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s): {sorted(unknown)}")


def config_schema(cls: type) -> list[dict[str, Any]]:
    """A config class's fields with types, defaults and allowed values: what explorers may turn."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        row: dict[str, Any] = {"name": f.name, "type": str(f.type),
                               "default": default.value if isinstance(default, Enum) else default}
        if isinstance(default, Enum):
            row["choices"] = [e.value for e in type(default)]
        rows.append(row)
    return rows


@dataclass(frozen=True)
class EngineConfig(ConfigOps):
    PAIR_FIELDS: ClassVar[tuple[str, ...]] = ("kernel_table",)
    drafter: DrafterKind = DrafterKind.NGRAM
    draft_len: int = 5  # k: draft tokens proposed per step (chain); vLLM's documented ngram example uses 5
    ngram_max: int = 4  # longest suffix tried for a lookup match (vLLM prompt_lookup_max)
    ngram_min: int = 1  # shortest suffix accepted as a match (vLLM prompt_lookup_min)
    verify: VerifyMode = VerifyMode.CHAIN
    tree_budget: int = 16  # max draft nodes verified per step (tree / two-level)
    tree_width: int = 4  # max children per node when growing a tree
    level_one_keep: int = 8  # two-level: nodes kept after the cheap first level
    level_one_rule: LevelOneRule = LevelOneRule.SHALLOW
    level_one_layers: int = 0  # SHALLOW rule: target layers run by level one (0: a quarter of them)
    tree_depth: int = 0  # deepest tree level a block drafter grows (0: block_size - 1)
    block_size: int = 16  # block drafter: tokens drafted per forward
    # Block drafter: its attention sees the target features of the context's last drafter_window positions only (0:
    # all). A drafter trained on short sequences loses its way over long contexts: the shipped SmolLM2 one (trained
    # on ~350-token sequences) drafts past position 1024 with half its accuracy at 256 (replayed, drafting.replay).
    drafter_window: int = 0
    # Block drafter: its LM head keeps the rows of the drafter_head_rows tokens the target generated most often
    # (the drafter's token_ranking.json; 0: every row). A head a third as large is a third of the head's bytes and
    # top-k work a draft; the target's outputs outside it cannot be proposed by the block (lookup still can).
    drafter_head_rows: int = 0
    # Block drafter on the Triton kernels: its projections' launch settings (a draft is a proposal, so they may
    # change its reduction order).
    drafter_launches: DrafterLaunches = DrafterLaunches.TUNED
    drafter_topk: DrafterTopk = DrafterTopk.CHUNKS  # where the fused draft ranks its head's logits
    # Block drafter (chain or tree) and n-gram (chain): up to this many speculative steps run on the device (one
    # CUDA graph) per host round trip, trees in a static shape calibrated on the first host steps
    # (engines.device_loop); 1 = the host drives every step. Output is the same either way.
    device_steps: int = 4
    # The device loop queues each next chunk of device_steps steps before reading the current one's tokens: the
    # host's work between chunks overlaps the device's. The chunk queued behind a stop is skipped on the device
    # (engines.graph_if; where that is unsupported it runs, its steps dropped). Needs the device loop: a drafter
    # with a device half. On the H200 (session 34) device_steps 1 with overlap ran the lookup-led chain fastest.
    device_overlap: bool = False
    # Tree verification in the device loop: the best-first tree of each step's own candidates (the host loop's tree,
    # at most 127 nodes), grown on the device inside the step, or a static shape calibrated on the first steps. On
    # the H200 (session 36, 16 rows led by lookup) the grown tree accepted 5.23 tokens a step against the
    # calibrated one's 4.72 at the same verify cost: 2.83x against 2.44x.
    device_tree: DeviceTree = DeviceTree.PER_STEP
    # The device loop's tree steps run the block drafter's observe (fc, context keys and values) over every tree row
    # on a second CUDA stream as soon as the target's last captured layer has run, beside its remaining layers, LM
    # head and commit; the move then places the accepted path's drafter rows with the target's. The observe leaves
    # the step's critical path; the drafts are the same (engines.side_stream). Needs the device loop (device_steps
    # > 1 or device_overlap) and no torch.compile of the step. Not yet measured: off.
    observe_overlap: bool = False
    # Grown trees led by lookup (ngram_prefix, device_tree per_step) in the device loop: the lookup runs on a second
    # CUDA stream beside the block's draft instead of after it (its gate, which reads the draft's depth-1 candidates,
    # moves into the grow launch). The same trees; no torch.compile of the step. Not yet measured: off.
    lookup_overlap: bool = False
    # AR decoding (no drafter): greedy steps chained in one CUDA graph per host round trip (ModelRunner.decode; with
    # the fused kernels). The steps after an EOS are skipped on the device (engines.graph_if), so longer chains cost
    # nothing at a stop; the tokens are the same at any value.
    ar_steps: int = 4
    # Block drafter, chain or tree: where the context has a prompt-lookup match (ngram_max/ngram_min), its tokens
    # lead the block's candidates: the chain's first tokens, the tree's main path (engines.drafters.ngram_prefix).
    ngram_prefix: bool = False
    # ngram_prefix's gate: a step's lookup match leads only where the block drafter does not contradict it: the match's
    # first token is among the block's top `lookup_agree_topk` candidates at depth 1, or the block's top-1 there has
    # probability below `lookup_doubt_prob` (0: the match leads wherever there is one). A 1-gram match often
    # overrides a confident, right drafter (replayed on SmolLM2: drafting.replay).
    lookup_agree_topk: int = 0
    lookup_doubt_prob: float = 0.5
    # ngram_prefix with a tree: the lookup's match leads up to this many tokens deep, past the block's depth (0: the
    # block's depth); the levels past the block's hold the match's token alone. In long repetitive stretches a step
    # then commits more than a block (SmolLM2 on the H200, 32 rows: 5.72 -> 6.70 tokens/step, as replayed).
    lookup_depth: int = 0
    # Prompt lookup (n-gram drafter, ngram_prefix): a match's continuation that runs into the context's end repeats
    # the text since the occurrence, so a loop shorter than the draft fills it (replayed on SmolLM2's H200 outputs,
    # 32 rows with lookup_depth 31: 6.70 -> 7.70 tokens/step; 16 rows: unchanged).
    lookup_periodic: bool = False
    # Grown trees, one step a chunk (device_steps 1): a step verifies this narrower tree unless the step two before it
    # accepted at least wide_tree_after draft tokens; then tree_budget's (0: tree_budget's always). Loops announce
    # themselves a step ahead, and only there a wide deep tree pays for its costlier verify (replayed with the H200's
    # step costs: 16 / 32 rows 3.46x / 3.44x, switched 3.77x; scripts/replay_adaptive_rows.py). Two steps back is
    # what the host knows when it queues an overlapped chunk, so host and device loops take the same steps.
    narrow_tree_budget: int = 0
    wide_tree_after: int = 8
    # ... and a deeper tree of deep_tree_budget nodes (0: none) where the step two before accepted at least
    # deep_tree_after draft tokens: a loop the periodic lookup predicts past tree_budget's depth runs at 64 or 128
    # rows (replayed on the H200's 40 outputs at 1.5 ms a 64-row step: switched 15/31 4.145x -> 4.321x with 63 after
    # 16; measured on an H100, 80 requests: 127 against 63, 4.43x against 4.38x, the loops 15.0x against 13.9x).
    deep_tree_budget: int = 0
    deep_tree_after: int = 16
    # ... that deep step verifying a chain of deep_tree_budget nodes instead (the lookup's match where it leads, else
    # the block's first candidate; lookup_depth >= deep_tree_budget): a loop's deep tree is that chain anyway, and a
    # chain's rows sit at slots base.. in position order, so its attention reads keys in slot order (no block slots:
    # 13.8 against 22.6 us a layer at 128 rows, 1024 keys, on an H100) and no grow launch runs. Session 56 (H100, 40
    # requests): 4.51x against 4.42x, the loops 1.10x. Growing nothing, the chain (and its lookup) may run up to
    # MAX_CHAIN_NODES deep.
    deep_tree_chain: bool = False
    dtype: DType = DType.BF16
    weight_format: WeightFormat = WeightFormat.NATIVE
    kernel_backend: KernelBackend = KernelBackend.TORCH
    # Exactness: every decode/verify forward runs at one fixed token count (token_tile) so every kernel sees
    # the same shapes and reduces each row in the same order; AR and speculative decoding then agree bit for
    # bit. Off = fastest shapes per step (AR at 1 token), exactness not claimed.
    batch_invariant: bool = True
    token_tile: int = 16
    # Tree nodes sit at other KV slots than AR puts them; with this on, every token reads its keys in position
    # order (through its ancestors' slots), so tree verification is bit-exact against AR, not only token-exact.
    # Costs a per-row key gather (torch path) or per-token attention programs (Triton). Chains need it not.
    position_ordered_attention: bool = False
    cuda_graphs: bool = True
    compile: bool = False  # torch.compile the step function (GPU)
    # Hybrid recurrent targets only (Gated DeltaNet layers; ignored by Llama targets), see HybridConfig: store
    # the recurrent state every this many tree levels during a verify (committing an unstored node replays at
    # most spacing - 1 updates), and run a tree's rows depth-first with leaf children first.
    state_checkpoint_spacing: int = 1
    tree_dfs_order: bool = True
    max_seq_len: int = 4096  # static KV cache length (prompt + new tokens + one tile of slack)
    kernel_table: tuple[tuple[str, str], ...] = ()  # (kernel@shape, launch params JSON) from tune_kernels

    def __post_init__(self) -> None:
        self._coerce_enums((("drafter", DrafterKind), ("verify", VerifyMode), ("dtype", DType),
                            ("level_one_rule", LevelOneRule), ("weight_format", WeightFormat),
                            ("kernel_backend", KernelBackend), ("device_tree", DeviceTree),
                            ("drafter_launches", DrafterLaunches), ("drafter_topk", DrafterTopk)))
        _check(1 <= self.draft_len <= 64, f"draft_len={self.draft_len}: must be in 1..64")
        _check(1 <= self.ngram_min <= self.ngram_max <= 16,
               f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need 1 <= min <= max <= 16")
        _check(_is_int(self.lookup_agree_topk) and 0 <= self.lookup_agree_topk <= 16,
               f"lookup_agree_topk={self.lookup_agree_topk!r}: must be an int in 0..16")
        _check(isinstance(self.lookup_doubt_prob, (int, float)) and not isinstance(self.lookup_doubt_prob, bool)
               and 0.0 <= self.lookup_doubt_prob <= 1.0,
               f"lookup_doubt_prob={self.lookup_doubt_prob!r}: must be in 0..1")
        _check(1 <= self.tree_budget <= 256, f"tree_budget={self.tree_budget}: must be in 1..256")
        most = MAX_CHAIN_NODES if self.deep_tree_chain is True else MAX_GROWN_NODES
        _check(_is_int(self.lookup_depth) and 0 <= self.lookup_depth <= most,
               f"lookup_depth={self.lookup_depth!r}: must be an int in 0..{most} (0: the block's depth; past "
               f"{MAX_GROWN_NODES} with deep_tree_chain only)")
        _check(1 <= self.tree_width <= 16, f"tree_width={self.tree_width}: must be in 1..16")
        _check(self.device_tree is DeviceTree.CALIBRATED or self.verify is not VerifyMode.TREE
               or self.tree_budget <= MAX_GROWN_NODES
               or (self.device_steps <= 1 and not self.device_overlap),  # the host loop grows any tree
               f"tree_budget={self.tree_budget}: device_tree=per_step grows at most {MAX_GROWN_NODES} nodes on the "
               "device loop "
               "(device_tree: calibrated verifies a larger static tree there)")
        _check(1 <= self.level_one_keep <= self.tree_budget,
               f"level_one_keep={self.level_one_keep}: must be in 1..tree_budget ({self.tree_budget})")
        _check(1 <= self.block_size <= 64, f"block_size={self.block_size}: must be in 1..64")
        _check(_is_int(self.drafter_window) and 0 <= self.drafter_window <= 1 << 20,
               f"drafter_window={self.drafter_window!r}: must be an int >= 0 (0: the whole context)")
        rows = self.drafter_head_rows
        _check(_is_int(rows) and (rows == 0 or 16 <= rows <= 1 << 24),
               f"drafter_head_rows={self.drafter_head_rows!r}: must be 0 (the whole head) or an int >= 16")
        for name in ("device_steps", "ar_steps"):
            value = getattr(self, name)
            _check(_is_int(value) and 1 <= value <= 16, f"{name}={value!r}: must be an int in 1..16")
        _check(0 <= self.tree_depth < max(self.block_size, 2), f"tree_depth={self.tree_depth}: must be in 0..block_size-1")
        _check(self.level_one_layers >= 0, f"level_one_layers={self.level_one_layers}: must be >= 0")
        _check(self.token_tile in (1, 2, 4, 8, 16, 32, 64), f"token_tile={self.token_tile}: must be a power of 2 <= 64")
        _check(self.max_seq_len >= 64, f"max_seq_len={self.max_seq_len}: must be >= 64")
        _check(_is_int(self.state_checkpoint_spacing) and 1 <= self.state_checkpoint_spacing <= MAX_CHECKPOINT_SPACING,
               f"state_checkpoint_spacing={self.state_checkpoint_spacing!r}: must be an int in "
               f"1..{MAX_CHECKPOINT_SPACING}")
        for name in ("tree_dfs_order", "cuda_graphs", "batch_invariant", "ngram_prefix", "device_overlap",
                     "lookup_periodic", "observe_overlap", "lookup_overlap"):
            _check(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r}: must be a bool")
        if self.weight_format is WeightFormat.W12 and (self.kernel_backend is not KernelBackend.TRITON
                                                        or self.dtype is not DType.BF16):
            raise ConfigError("weight_format=w12 decodes inside the Triton matmuls: it needs kernel_backend=triton "
                              "and dtype=bfloat16")
        if self.ngram_prefix and (self.drafter is not DrafterKind.BLOCK
                                  or self.verify not in (VerifyMode.CHAIN, VerifyMode.TREE)):
            raise ConfigError("ngram_prefix puts prompt lookup in front of a block drafter's chain or tree: it needs "
                              "drafter=block and verify=chain or tree")
        if self.lookup_depth and not (self.ngram_prefix and self.verify is VerifyMode.TREE
                                      and self.device_tree is DeviceTree.PER_STEP):
            raise ConfigError(f"lookup_depth={self.lookup_depth} lets ngram_prefix's match lead a grown tree past the "
                              "block's depth: it needs ngram_prefix=true, verify=tree and device_tree=per_step")
        _check(_is_int(self.narrow_tree_budget), f"narrow_tree_budget={self.narrow_tree_budget!r}: must be an int")
        if self.narrow_tree_budget and not (
                self.verify is VerifyMode.TREE and self.device_tree is DeviceTree.PER_STEP and self.device_steps == 1
                and 1 <= self.narrow_tree_budget < self.tree_budget):
            raise ConfigError(f"narrow_tree_budget={self.narrow_tree_budget}: a grown tree (verify=tree, device_tree="
                              "per_step) one step a chunk (device_steps=1), in 1..tree_budget-1 "
                              f"({self.tree_budget - 1})")
        _check(_is_int(self.wide_tree_after) and 0 <= self.wide_tree_after <= 64,
               f"wide_tree_after={self.wide_tree_after!r}: must be an int in 0..64")
        _check(_is_int(self.deep_tree_budget), f"deep_tree_budget={self.deep_tree_budget!r}: must be an int")
        if self.deep_tree_budget and not (
                self.verify is VerifyMode.TREE and self.device_tree is DeviceTree.PER_STEP and self.device_steps == 1
                and self.tree_budget < self.deep_tree_budget <= most):
            raise ConfigError(f"deep_tree_budget={self.deep_tree_budget}: a grown tree (verify=tree, device_tree="
                              f"per_step) one step a chunk (device_steps=1), in {self.tree_budget + 1}.."
                              f"{most} (above tree_budget; past {MAX_GROWN_NODES} as a chain only: deep_tree_chain)")
        _check(_is_int(self.deep_tree_after) and 0 <= self.deep_tree_after <= 64,
               f"deep_tree_after={self.deep_tree_after!r}: must be an int in 0..64")
        _check(isinstance(self.deep_tree_chain, bool), f"deep_tree_chain={self.deep_tree_chain!r}: must be a bool")
        if self.deep_tree_chain and not (self.deep_tree_budget and self.lookup_depth >= self.deep_tree_budget):
            raise ConfigError(f"deep_tree_chain: a chain of deep_tree_budget={self.deep_tree_budget} nodes needs a "
                              f"deep step (deep_tree_budget > 0) and a lookup at least as deep (lookup_depth="
                              f"{self.lookup_depth})")
        if self.lookup_depth and self.lookup_depth < (self.tree_depth or self.block_size - 1):
            raise ConfigError(f"lookup_depth={self.lookup_depth}: below the block's depth "
                              f"({self.tree_depth or self.block_size - 1}); 0 means the block's depth")
        if self.lookup_agree_topk and not self.ngram_prefix:
            raise ConfigError(f"lookup_agree_topk={self.lookup_agree_topk} gates ngram_prefix's lookup: it needs "
                              "ngram_prefix=true")
        if self.device_overlap and not (self.drafter is DrafterKind.BLOCK and self.verify is not VerifyMode.TWO_LEVEL
                                        or self.drafter is DrafterKind.NGRAM and self.verify is VerifyMode.CHAIN):
            raise ConfigError("device_overlap queues the device loop's chunks: it needs a drafter with a device half "
                              "(block with chain or tree verification, or ngram with a chain)")
        if self.observe_overlap and not (self.drafter is DrafterKind.BLOCK and self.verify is VerifyMode.TREE
                                         and (self.device_steps > 1 or self.device_overlap) and not self.compile):
            raise ConfigError("observe_overlap observes a tree step's rows beside the target's last layers in the "
                              "device loop: it needs drafter=block, verify=tree, device_steps > 1 or device_overlap, "
                              "and compile=false")
        if self.lookup_overlap and not (self.ngram_prefix and self.verify is VerifyMode.TREE
                                        and self.device_tree is DeviceTree.PER_STEP
                                        and (self.device_steps > 1 or self.device_overlap) and not self.compile):
            raise ConfigError("lookup_overlap runs a lookup-led tree's lookup beside the block's draft in the device "
                              "loop: it needs ngram_prefix, verify=tree, device_tree=per_step, device_steps > 1 or "
                              "device_overlap, and compile=false")
        if self.verify is not VerifyMode.CHAIN and self.drafter in (DrafterKind.NONE,):
            raise ConfigError(f"verify={self.verify.value} needs a drafter")
        object.__setattr__(self, "kernel_table", tuple(tuple(p) for p in self.kernel_table))

    @property
    def speculative(self) -> bool:
        return self.drafter is not DrafterKind.NONE

    # Fields that only shape what is drafted and verified, never how a row is computed.
    DRAFT_FIELDS: ClassVar[tuple[str, ...]] = (
        "drafter", "draft_len", "ngram_max", "ngram_min", "verify", "tree_budget", "tree_width", "level_one_keep",
        "level_one_rule", "level_one_layers", "tree_depth", "block_size", "drafter_window", "drafter_head_rows",
        "drafter_launches", "drafter_topk", "device_steps", "device_overlap", "device_tree", "observe_overlap",
        "lookup_overlap", "ngram_prefix", "lookup_agree_topk", "lookup_doubt_prob", "lookup_depth", "lookup_periodic",
        "narrow_tree_budget", "wide_tree_after", "deep_tree_budget", "deep_tree_after", "deep_tree_chain")

    def ar_twin(self) -> "EngineConfig":
        """The autoregressive configuration whose tokens this one must reproduce: the same numerics (dtype,
        weights, kernels, tile, attention order, table), no drafter. Two configs with equal twins share one
        exact AR reference; a knob such as position_ordered_attention changes AR's own bits on the torch backend,
        so a variant that turns it is held to the AR that has it too."""
        plain = EngineConfig(drafter=DrafterKind.NONE)
        return self.replace(**{f: getattr(plain, f) for f in self.DRAFT_FIELDS})


def knob_schema() -> list[dict[str, Any]]:
    """EngineConfig's fields with types, defaults and allowed values: what explorers may turn."""
    return config_schema(EngineConfig)


def _is_int(value: Any) -> bool:
    """An int proper (YAML's true/false are bools, which Python counts as ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)

