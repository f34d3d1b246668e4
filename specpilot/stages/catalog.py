"""The mechanism catalog: named mechanisms, the knobs each turns (with ranges), where each applies, and which
cost-model directions it addresses. The search proposer optimises over the knobs of a round's space (as Optuna
parameters: stages/search_params.py).

Knobs turn EngineConfig fields, or, for the batched engine, BatchConfig fields (the drafter choice picks one of
the deployment's drafters, whose model the session loads). Stock is the deployment's first listed drafter with its
published defaults (and, in the batch regime, every batching mechanism off). Mechanisms name the target families
and serving regimes they apply to: hybrid recurrent targets have knobs of their own (tree or chain verification
with per-branch recurrent state, state checkpoint spacing) and none of the Llama runner's torch.compile; the batch
regime's engine reads the n-gram knobs and its three batching mechanisms, and the single regime never sees those.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from specpilot.costmodel import DirectionName
from specpilot.deployments import Deployment, DeviceKind, RegimeKind
from specpilot.engines.batch.config import MECHANISMS as BATCH_MECHANISMS
from specpilot.engines.batch.config import BatchConfig, DraftLength, VerifyBudget
from specpilot.engines.config import (MAX_GROWN_NODES, DeviceTree, DrafterKind, DrafterTopk, DType, EngineConfig,
                                      KernelBackend, VerifyMode, WeightFormat)
from specpilot.engines.family import TargetFamily
from specpilot.kernels.table import PROJECTIONS, numerics_only
from specpilot.memory import MechanismCategory
from specpilot.stages.batch_catalog import BATCH_DELTA, batch_delta, stock_batch
from specpilot.stages.candidate import Candidate, CandidateSource

DRAFTER_PARAM = "drafter_label"  # the one search parameter that is not an EngineConfig field


class KnobDomain(str, Enum):
    INT = "int"  # integers low..high
    CHOICE = "choice"  # one of `choices`


class KnobTarget(str, Enum):
    """Which config a knob turns."""
    ENGINE = "engine"  # an EngineConfig field
    BATCH = "batch"  # a BatchConfig field (the batched engine; batch-regime deployments only)

    @property
    def fields(self) -> dict[str, Any]:
        return (EngineConfig if self is KnobTarget.ENGINE else BatchConfig).__dataclass_fields__


@dataclass(frozen=True)
class Knob:
    field: str  # a field of the target's config (or DRAFTER_PARAM)
    domain: KnobDomain
    low: int = 0
    high: int = 0
    choices: tuple[Any, ...] = ()
    target: KnobTarget = KnobTarget.ENGINE

    def __post_init__(self) -> None:
        object.__setattr__(self, "domain", KnobDomain(self.domain))
        object.__setattr__(self, "target", KnobTarget(self.target))
        if self.field != DRAFTER_PARAM and self.field not in self.target.fields:
            raise ValueError(f"knob {self.field!r} is not a {self.target.value} config field")
        if self.domain is KnobDomain.INT and not self.low <= self.high:
            raise ValueError(f"knob {self.field}: empty range {self.low}..{self.high}")
        if self.domain is KnobDomain.CHOICE and not self.choices:
            raise ValueError(f"knob {self.field}: no choices")

    def size(self) -> int:
        return self.high - self.low + 1 if self.domain is KnobDomain.INT else len(self.choices)


@dataclass(frozen=True)
class CatalogMechanism:
    name: str
    category: MechanismCategory
    description: str
    knobs: tuple[Knob, ...]
    addresses: frozenset[DirectionName]
    drafters: frozenset[DrafterKind] = frozenset()  # applies when the build drafts with one of these (empty: any)
    devices: frozenset[DeviceKind] = frozenset(DeviceKind)
    families: frozenset[TargetFamily] = frozenset(TargetFamily)  # target families whose engines read the knobs
    regimes: frozenset[RegimeKind] = frozenset({RegimeKind.SINGLE})  # serving regimes whose engines read the knobs

    def __post_init__(self) -> None:
        for name, enum in (("drafters", DrafterKind), ("devices", DeviceKind), ("families", TargetFamily),
                           ("regimes", RegimeKind)):
            object.__setattr__(self, name, frozenset(enum(v) for v in getattr(self, name)))
        if not self.families or not self.devices or not self.regimes:
            raise ValueError(f"mechanism {self.name}: applies to no target family, device or regime")
        if RegimeKind.SINGLE in self.regimes and any(k.target is KnobTarget.BATCH for k in self.knobs):
            raise ValueError(f"mechanism {self.name}: BatchConfig knobs mean nothing to the single regime")

    @property
    def batched(self) -> bool:
        """Turns the batched engine's BatchConfig."""
        return any(k.target is KnobTarget.BATCH for k in self.knobs)

    def applies(self, build: EngineConfig, device: DeviceKind, family: TargetFamily = TargetFamily.LLAMA,
                regime: RegimeKind = RegimeKind.SINGLE) -> bool:
        if device not in self.devices or family not in self.families or regime not in self.regimes:
            return False
        if self.drafters and build.drafter not in self.drafters:
            return False
        if any(k.field == "token_tile" for k in self.knobs):  # the tile shapes batch-invariant forwards: all of the
            # hybrid runner's, only the stock kernels' on Llama targets (the fused kernels are invariant at any width)
            stock = build.kernel_backend is KernelBackend.TORCH
            return build.batch_invariant and (family is TargetFamily.HYBRID or stock)
        if any(k.field == "weight_format" for k in self.knobs):  # W12 decodes inside the Triton matmuls, to bf16
            return build.kernel_backend is KernelBackend.TRITON and build.dtype is DType.BF16
        return True


_ALL = frozenset(DirectionName)
_CUDA = frozenset({DeviceKind.CUDA})
_ANY_DEVICE = frozenset(DeviceKind)
_LLAMA, _HYBRID = frozenset({TargetFamily.LLAMA}), frozenset({TargetFamily.HYBRID})
_CHAIN_DRAFTERS = frozenset({DrafterKind.NGRAM, DrafterKind.DRAFT_MODEL})
_INT, _CHOICE, _BATCH = KnobDomain.INT, KnobDomain.CHOICE, KnobTarget.BATCH
_NGRAM = frozenset({DrafterKind.NGRAM})
_BOTH_REGIMES, _BATCHED = frozenset(RegimeKind), frozenset({RegimeKind.BATCH})
CATALOG: tuple[CatalogMechanism, ...] = (
    # The batched engine drafts by n-gram lookup too (its fixed draft length is stock's), so these two serve both.
    CatalogMechanism("ngram_draft_length", MechanismCategory.ALGORITHM, "n-gram lookup: draft tokens per step",
                     (Knob("draft_len", _INT, 1, 12),), frozenset({DirectionName.TREE_SHAPE, DirectionName.OVERHEAD}),
                     _NGRAM, regimes=_BOTH_REGIMES),
    CatalogMechanism("ngram_window", MechanismCategory.ALGORITHM, "n-gram lookup: longest and shortest suffix matched",
                     (Knob("ngram_max", _INT, 1, 8), Knob("ngram_min", _INT, 1, 4)),
                     frozenset({DirectionName.TREE_SHAPE}), _NGRAM, regimes=_BOTH_REGIMES),
    # The batched engine's mechanisms (engines/batch/config.py), batch regime only. A fixed draft length
    # ignores max_draft_len and an unbudgeted verify ignores verify_budget_max: search_params pins those.
    CatalogMechanism("goodput_draft", MechanismCategory.SCHEDULING,
                     "batched engine: each request's draft length re-chosen every step from its recent acceptance "
                     "(maximising expected tokens per second of step cost), up to a longest draft",
                     (Knob("draft_length", _CHOICE, choices=tuple(d.value for d in DraftLength), target=_BATCH),
                      Knob("max_draft_len", _INT, 2, 16, target=_BATCH)),
                     frozenset({DirectionName.TREE_SHAPE, DirectionName.OVERHEAD}), _NGRAM, regimes=_BATCHED),
    CatalogMechanism("verify_budget", MechanismCategory.SCHEDULING,
                     "batched engine: one verify-token budget per step, sized from the target forward's cost curve and "
                     "handed to the (request, position) slots most likely to be accepted",
                     (Knob("verify_budget", _CHOICE, choices=tuple(v.value for v in VerifyBudget), target=_BATCH),
                      Knob("verify_budget_max", _CHOICE, choices=(0, 16, 32, 64), target=_BATCH)),
                     frozenset({DirectionName.TREE_SHAPE, DirectionName.KERNELS}), _NGRAM, regimes=_BATCHED),
    CatalogMechanism("overlap_draft", MechanismCategory.SCHEDULING,
                     "batched engine: draft the next step on the host while the device verifies this one",
                     (Knob("overlap_draft", _CHOICE, choices=(False, True), target=_BATCH),),
                     frozenset({DirectionName.OVERHEAD}), _NGRAM, regimes=_BATCHED),
    # Off the CPU only: there the lookup's torch reference scans every row's whole buffer a step (1.6 ms at 24 rows),
    # slower than the host's incremental index.
    CatalogMechanism("device_draft", MechanismCategory.SCHEDULING,
                     "batched engine: prompt lookup on the device inside the verify step's own forward, every row's "
                     "next draft returned with the step's result (no host drafting)",
                     (Knob("device_draft", _CHOICE, choices=(False, True), target=_BATCH),),
                     frozenset({DirectionName.OVERHEAD}), _NGRAM, _CUDA, regimes=_BATCHED),
    CatalogMechanism("extrapolate", MechanismCategory.ALGORITHM,
                     "batched engine: prompt lookup inside periodic text proposes the next value of a token that steps "
                     "between periods (a count), not a copy of the last one, and goes on repeating the loop up to the "
                     "draft length",
                     (Knob("extrapolate", _CHOICE, choices=(False, True), target=_BATCH),),
                     frozenset({DirectionName.TREE_SHAPE}), _NGRAM, regimes=_BATCHED),
    CatalogMechanism("draft_model_length", MechanismCategory.ALGORITHM, "draft model: draft tokens per step",
                     (Knob("draft_len", _INT, 1, 12),), frozenset({DirectionName.TREE_SHAPE, DirectionName.OVERHEAD}),
                     frozenset({DrafterKind.DRAFT_MODEL})),
    CatalogMechanism("block_tree_shape", MechanismCategory.ALGORITHM,
                     "block drafter: chain, best-first tree or two-level verification and the tree's node budget; a "
                     "grown tree may verify a narrower budget except after a step that accepted much, and a deeper "
                     "one (or a chain of its nodes, read in slot order) after a step that accepted more",
                     (Knob("verify", _CHOICE, choices=tuple(v.value for v in VerifyMode)),
                      Knob("tree_budget", _INT, 4, MAX_GROWN_NODES), Knob("tree_width", _INT, 1, 8),
                      Knob("level_one_keep", _INT, 2, 32), Knob("narrow_tree_budget", _CHOICE, choices=(0, 7, 15)),
                      Knob("wide_tree_after", _CHOICE, choices=(4, 8, 12)),
                      Knob("deep_tree_budget", _CHOICE, choices=(0, 47, 63, 127, 255)),
                      Knob("deep_tree_after", _CHOICE, choices=(8, 16, 31)),
                      Knob("deep_tree_chain", _CHOICE, choices=(False, True))),
                     frozenset({DirectionName.TREE_SHAPE}), frozenset({DrafterKind.BLOCK}), families=_LLAMA),
    CatalogMechanism("ngram_prefix", MechanismCategory.ALGORITHM,
                     "block drafter led by prompt lookup: where the context repeats, the lookup's match is the chain's "
                     "first tokens or the tree's main path, the block's candidates after and beside it; the gate lets "
                     "a match lead only where the block does not contradict it; a grown tree may follow a long match "
                     "past the block's depth (lookup_depth), a periodic lookup repeating a loop the draft outruns",
                     (Knob("ngram_prefix", _CHOICE, choices=(False, True)), Knob("ngram_min", _INT, 1, 4),
                      Knob("lookup_agree_topk", _INT, 0, 4),
                      Knob("lookup_doubt_prob", _CHOICE, choices=(0.3, 0.5, 0.7)),
                      Knob("lookup_depth", _CHOICE, choices=(0, 31, 63, 127, 255)),
                      Knob("lookup_periodic", _CHOICE, choices=(False, True))),
                     frozenset({DirectionName.TREE_SHAPE}), frozenset({DrafterKind.BLOCK}), families=_LLAMA),
    CatalogMechanism("drafter_window", MechanismCategory.ALGORITHM,
                     "block drafter sees only the context's last positions: a drafter trained on short sequences "
                     "keeps its accuracy over long outputs",
                     (Knob("drafter_window", _CHOICE, choices=(0, 128, 256, 512)),),
                     frozenset({DirectionName.TREE_SHAPE}), frozenset({DrafterKind.BLOCK}), families=_LLAMA),
    CatalogMechanism("drafter_head_rows", MechanismCategory.ALGORITHM,
                     "block drafter's LM head on the tokens the target generates most (the drafter's token ranking): "
                     "a fraction of the head's bytes and top-k work a draft, for the few target tokens it cannot "
                     "propose (lookup still can)",
                     (Knob("drafter_head_rows", _CHOICE, choices=(0, 4096, 8192, 16384)),),
                     frozenset({DirectionName.TREE_SHAPE, DirectionName.KERNELS}), frozenset({DrafterKind.BLOCK}),
                     families=_LLAMA),
    CatalogMechanism("drafter_topk", MechanismCategory.KERNEL,
                     "block drafter's head ranks its own column tiles in its epilogue and a merge picks each row's "
                     "top-k: the logits are never stored and re-read, one launch fewer a draft",
                     (Knob("drafter_topk", _CHOICE, choices=tuple(t.value for t in DrafterTopk)),),
                     frozenset({DirectionName.KERNELS, DirectionName.OVERHEAD}), frozenset({DrafterKind.BLOCK}),
                     _CUDA, _LLAMA),
    # Off the CPU only: without CUDA graphs the device loop's steps run eagerly, no host round trip to save.
    CatalogMechanism("device_loop", MechanismCategory.SCHEDULING,
                     "speculative steps per host round trip: draft, verify, accept and commit on the device, several "
                     "steps one CUDA graph; overlap queues each next chunk before the host reads the current one (a chunk "
                     "queued behind a stop is skipped on the device)",
                     (Knob("device_steps", _CHOICE, choices=(1, 2, 4, 8)),
                      Knob("device_overlap", _CHOICE, choices=(False, True)),
                      Knob("device_tree", _CHOICE, choices=tuple(t.value for t in DeviceTree))),
                     frozenset({DirectionName.OVERHEAD}), frozenset({DrafterKind.NGRAM, DrafterKind.BLOCK}), _CUDA,
                     _LLAMA),
    # The device loop's second stream (engines.side_stream): launches that need nothing of the step's critical path
    # leave it; the same drafts and tokens. Off the CPU only, as the device loop.
    CatalogMechanism("side_stream", MechanismCategory.SCHEDULING,
                     "a second CUDA stream in the device loop's tree steps: the block drafter's observe of every tree "
                     "row beside the target's last layers, prompt lookup beside the block's draft (its gate read by the "
                     "grow launch); the same drafts, fewer launches on the step's critical path",
                     (Knob("observe_overlap", _CHOICE, choices=(False, True)),
                      Knob("lookup_overlap", _CHOICE, choices=(False, True))),
                     frozenset({DirectionName.OVERHEAD}), frozenset({DrafterKind.BLOCK}), _CUDA, _LLAMA),
    CatalogMechanism("token_tile", MechanismCategory.KERNEL, "batch-invariant forward width (every step runs at it)",
                     (Knob("token_tile", _CHOICE, choices=(8, 16)),),
                     frozenset({DirectionName.KERNELS, DirectionName.OVERHEAD})),
    CatalogMechanism("cuda_graphs", MechanismCategory.SCHEDULING, "replay each step as a captured CUDA graph",
                     (Knob("cuda_graphs", _CHOICE, choices=(True, False)),), frozenset({DirectionName.OVERHEAD}),
                     devices=_CUDA),
    CatalogMechanism("torch_compile", MechanismCategory.KERNEL, "torch.compile the step function",
                     (Knob("compile", _CHOICE, choices=(False, True)),),
                     frozenset({DirectionName.KERNELS, DirectionName.OVERHEAD}), devices=_CUDA,
                     families=_LLAMA),  # the hybrid runner does not compile its step
    # Issue #6: the lossless 12-bit weights read ~1.52 bytes a weight instead of 2, decoded inside the projections'
    # K loops (bit-identical outputs); whether that pays is the hardware's call (H200, Llama-3-8B shapes, session
    # 31: each W12 launch 0.76-1.05x of bf16's, the tuned step 0.97x), so the loop measures it like any knob. The
    # batched forward is the same fused one (tests/test_batch.py: W12 batched outputs = native's).
    CatalogMechanism("w12_weights", MechanismCategory.KERNEL,
                     "lossless 12-bit weights (sign+mantissa byte, 4-bit exponent code) decoded inside the Triton "
                     "matmuls: fewer weight bytes a step, the same bits",
                     (Knob("weight_format", _CHOICE, choices=tuple(w.value for w in WeightFormat)),),
                     frozenset({DirectionName.KERNELS}), devices=_CUDA, families=_LLAMA, regimes=_BOTH_REGIMES),
    CatalogMechanism("triton_kernels", MechanismCategory.KERNEL,
                     "SpecPilot's batch-invariant Triton kernels (fused Llama layers; the Gated DeltaNet tree scan)",
                     (Knob("kernel_backend", _CHOICE, choices=tuple(b.value for b in KernelBackend)),),
                     frozenset({DirectionName.KERNELS}), devices=_CUDA),
    # Hybrid recurrent targets (Gated DeltaNet + attention). A tree's extra nodes are the drafter's own runner-up
    # candidates as leaves: they hold their parent's recurrent state on chip, so they cost rows, not state traffic.
    CatalogMechanism("hybrid_tree_verify", MechanismCategory.ALGORITHM,
                     "hybrid targets: verify a tree (the draft chain plus the drafter's alternatives as leaves, "
                     "per-branch recurrent state) or the chain alone, and the tree's node budget and width",
                     (Knob("verify", _CHOICE, choices=(VerifyMode.CHAIN.value, VerifyMode.TREE.value)),
                      Knob("tree_budget", _INT, 4, 32), Knob("tree_width", _INT, 1, 4)),
                     frozenset({DirectionName.TREE_SHAPE}), _CHAIN_DRAFTERS, _ANY_DEVICE, _HYBRID),
    CatalogMechanism("hybrid_state_checkpoints", MechanismCategory.KERNEL,
                     "hybrid targets: recurrent-state checkpoint spacing during verify (state writes vs replayed "
                     "updates at commit) and depth-first tree order (fewer state reloads)",
                     (Knob("state_checkpoint_spacing", _CHOICE, choices=(1, 2, 4, 8, 16)),
                      Knob("tree_dfs_order", _CHOICE, choices=(True, False))),
                     frozenset({DirectionName.KERNELS, DirectionName.OVERHEAD}), families=_HYBRID),
)
# Mechanisms set by other means than the search: the drafter choice is a search parameter of its own, the
# kernel table comes from the tune_kernels stage (and only matters with kernel_backend=triton).
DRAFTER_CHOICE = CatalogMechanism("drafter_choice", MechanismCategory.ALGORITHM,
                                  "which of the deployment's drafters proposes tokens", (), _ALL)
KERNEL_TABLE = CatalogMechanism("kernel_table", MechanismCategory.KERNEL,
                                "tuned Triton launch parameters per kernel, shape and token count", (),
                                frozenset({DirectionName.KERNELS}), devices=_CUDA)
BY_NAME: dict[str, CatalogMechanism] = {m.name: m for m in (*CATALOG, DRAFTER_CHOICE, KERNEL_TABLE)}
for _name, _delta in BATCH_MECHANISMS.items():  # each batching mechanism's entry turns its engine-side switch
    if not set(_delta) <= {k.field for k in BY_NAME[_name].knobs if k.target is KnobTarget.BATCH}:
        raise RuntimeError(f"catalog entry {_name} does not turn {sorted(_delta)} (engines/batch/config.py MECHANISMS)")


def stock_candidate(dep: Deployment) -> Candidate:
    """The deployment's first drafter with its published defaults on the default kernels; batch regime: served by
    the batched engine with every batching mechanism off (a fixed draft length for every request, every step)."""
    first = dep.drafters[0]
    return Candidate("stock", first.engine_config(dep.engine), source=CandidateSource.STOCK, drafter_label=first.label,
                     batch_config=stock_batch(dep))


def drafter_config(dep: Deployment, label: str) -> EngineConfig:
    configs = dep.drafter_configs()
    if label not in configs:
        raise ValueError(f"deployment {dep.name} has no drafter {label!r}; drafters: {sorted(configs)}")
    return configs[label]


@dataclass(frozen=True)
class SearchSpace:
    """The mechanisms searched this round: per drafter label, the applicable catalog mechanisms."""

    direction: DirectionName
    drafter_labels: tuple[str, ...]  # more than one: the drafter choice is searched too
    mechanisms: dict[str, tuple[CatalogMechanism, ...]]  # drafter label -> mechanisms applying to it
    widened: bool  # the direction's own mechanisms offered too few settings: every applicable one is searched

    def to_dict(self) -> dict[str, Any]:
        return {"direction": self.direction.value, "drafter_labels": list(self.drafter_labels), "widened": self.widened,
                "mechanisms": {label: [{"name": m.name, "category": m.category.value, "knobs": [
                    {"field": k.field, "target": k.target.value, "domain": k.domain.value, "low": k.low, "high": k.high,
                     "choices": list(k.choices)} for k in m.knobs]} for m in ms] for label, ms in self.mechanisms.items()}}


def search_space(dep: Deployment, build: Candidate, direction: DirectionName, min_settings: int) -> SearchSpace:
    """Mechanisms addressing `direction` that apply to the build on this device; widened to every applicable
    mechanism when they offer fewer than `min_settings` distinct settings."""
    labels = tuple(dep.drafter_configs())
    family = dep.target_family()

    def pick(only_direction: bool) -> dict[str, tuple[CatalogMechanism, ...]]:
        out = {}
        for label in labels:
            base = build.config if label == build.drafter_label else drafter_config(dep, label)
            base = base.replace(**{k: getattr(build.config, k) for k in _SHARED_FIELDS})
            out[label] = tuple(m for m in CATALOG if m.applies(base, dep.device.kind, family, dep.regime.kind)
                               and (not only_direction or direction in m.addresses))
        return out

    def settings(space: dict[str, tuple[CatalogMechanism, ...]]) -> int:
        total = 0
        for ms in space.values():
            n = 1
            for m in ms:
                for k in m.knobs:
                    n *= k.size()
            total += n
        return total

    chosen = pick(True)
    widened = settings(chosen) < min_settings
    return SearchSpace(direction, labels, pick(False) if widened else chosen, widened)


# Fields that are the build's, whichever drafter drafts (kernels, scheduling, exactness).
_SHARED_FIELDS = ("dtype", "weight_format", "kernel_backend", "batch_invariant", "token_tile", "cuda_graphs", "compile",
                  "max_seq_len", "kernel_table", "state_checkpoint_spacing", "tree_dfs_order")


def config_delta(base: EngineConfig, config: EngineConfig) -> dict[str, Any]:
    """Fields of `config` that differ from `base`, as JSON values."""
    b, c = base.to_dict(), config.to_dict()
    return {k: c[k] for k in c if c[k] != b[k]}


def mechanisms_in(base: Candidate, config: EngineConfig, drafter_label: str | None, *,
                  family: TargetFamily | None = None, batch: BatchConfig | None = None) -> tuple[str, ...]:
    """Catalog mechanisms whose knobs `config` (and `batch`, the batch regime's BatchConfig) turn relative to `base`
    (and the drafter choice); with `family`, only mechanisms of that target family (two may share a field)."""
    delta = {KnobTarget.ENGINE: config_delta(base.config, config),
             KnobTarget.BATCH: batch_delta(base.batch_config, batch) if batch is not None else {}}
    names = [DRAFTER_CHOICE.name] if drafter_label != base.drafter_label else []
    for m in CATALOG:
        if (m.drafters and config.drafter not in m.drafters) or (family is not None and family not in m.families):
            continue
        if any(k.field in delta[k.target] for k in m.knobs):
            names.append(m.name)
    engine = delta[KnobTarget.ENGINE]
    # a weight format's trial drops the projections' launch shapes (apply_delta): that table change is the format's
    implied = "weight_format" in engine and dict(config.kernel_table) == dict(
        numerics_only(base.config.kernel_table, PROJECTIONS))
    if "kernel_table" in engine and not implied:
        names.append(KERNEL_TABLE.name)
    return tuple(dict.fromkeys(names))


def with_kernel_table(candidate: Candidate, pairs: tuple[tuple[str, str], ...]) -> Candidate:
    """`candidate` with a tuned kernel table merged into its config (entries of the same key replaced)."""
    merged = tuple(sorted((dict(candidate.config.kernel_table) | dict(pairs)).items()))
    return Candidate(f"{candidate.name}+kernels", candidate.config.replace(kernel_table=merged), candidate.policy,
                     tuple(dict.fromkeys((*candidate.mechanisms, KERNEL_TABLE.name))), CandidateSource.SEARCH,
                     candidate.drafter_label, candidate.batch_config)


def mechanism_category(names: tuple[str, ...]) -> MechanismCategory:
    return BY_NAME[names[0]].category if names and names[0] in BY_NAME else MechanismCategory.ALGORITHM


def apply_delta(dep: Deployment, base: Candidate, delta: dict[str, Any],
                drafter_label: str | None) -> tuple[EngineConfig, str]:
    """`base` with `delta` (EngineConfig fields) applied; a delta that switches drafter starts from that drafter's
    stock config and keeps the build's shared (kernel/scheduling) fields. ConfigError/ValueError when it does not
    fit. BatchConfig fields are applied apart (batch_catalog.apply_batch_delta), and refused here."""
    if BATCH_DELTA in delta:
        raise ValueError(f"{BATCH_DELTA!r}: BatchConfig fields are applied by batch_catalog.apply_batch_delta")
    label = drafter_label or base.drafter_label
    if "drafter" in delta and delta["drafter"] != base.config.drafter.value:
        label = drafter_label or next((d.label for d in dep.drafters if d.kind.value == delta["drafter"]), None)
        if label is None:
            raise ValueError(f"deployment {dep.name} has no {delta['drafter']} drafter")
    start = base.config if label == base.drafter_label else drafter_config(dep, label).replace(
        **{k: getattr(base.config, k) for k in _SHARED_FIELDS})
    config = start.replace(**{k: v for k, v in delta.items() if k != "kernel_table"})
    if config.weight_format is not start.weight_format:  # the projections' launch shapes were tuned on the other
        # weights (W12's best tiles are not bf16's); their numerics stay, so the bits match the build's
        config = config.replace(kernel_table=numerics_only(config.kernel_table, PROJECTIONS))
    return config, label


def merge_deltas(deltas: list[dict[str, Any]]) -> tuple[dict[str, Any], list[int]]:
    """Union of deltas in order, skipping any that sets a field to a different value than an earlier one;
    returns the merged delta and the indices of the deltas it contains."""
    merged: dict[str, Any] = {}
    used = []
    for i, delta in enumerate(deltas):
        if all(merged.get(k, v) == v for k, v in delta.items()):
            merged.update(delta)
            used.append(i)
    return merged, used
