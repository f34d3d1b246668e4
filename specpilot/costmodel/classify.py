"""Kernel name -> op classes, for cuBLAS/aten kernels as the profiler names them and SpecPilot's Triton kernels.

A kernel maps to one op class when its name says which, and to several when it cannot: a generic GEMM runs
every linear layer, so its time is later split across the linear classes. Rules are tried in order and the
first match wins (flash-attention kernels contain "sm90"/"cutlass", the fused norm+linear Triton kernel
contains "linear_kernel", so the more specific rules come first).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from specpilot.engines.shapes import OpClass

LINEAR_OPS: tuple[OpClass, ...] = (OpClass.QKV, OpClass.O_PROJ, OpClass.GATE_UP, OpClass.DOWN, OpClass.LM_HEAD)
# SpecPilot's fused RMSNorm + linear runs the input and post-attention norms with the projections they feed.
NORM_LINEAR_OPS: tuple[OpClass, ...] = (OpClass.NORM, OpClass.QKV, OpClass.GATE_UP)


@dataclass(frozen=True)
class NameRule:
    ops: tuple[OpClass, ...]
    substrings: tuple[str, ...] = ()  # matched anywhere in the lower-cased name
    words: tuple[str, ...] = ()  # matched against whole words only (short patterns like "cat" or "mul")

    def matches(self, lowered: str, words: frozenset[str]) -> bool:
        return any(s in lowered for s in self.substrings) or any(w in words for w in self.words)


RULES: tuple[NameRule, ...] = (
    # SpecPilot's Triton kernels (Triton may append a signature suffix, hence substrings).
    NameRule(NORM_LINEAR_OPS, substrings=("rmsnorm_linear_kernel",)),
    NameRule((OpClass.ROPE_KV,), substrings=("rope_kv_write_kernel",)),
    NameRule((OpClass.ATTN,), substrings=("attention_kernel",)),
    NameRule((OpClass.ACT,), substrings=("swiglu_kernel",)),
    NameRule((OpClass.ACCEPT,), substrings=("greedy_accept_kernel",)),
    NameRule(LINEAR_OPS, substrings=("linear_kernel",)),
    # Kernels specialised per projection say which one.
    NameRule((OpClass.LM_HEAD,), substrings=("lm_head",)),
    NameRule((OpClass.QKV,), substrings=("qkv",)),
    NameRule((OpClass.O_PROJ,), substrings=("o_proj",)),
    NameRule((OpClass.GATE_UP,), substrings=("gate_up",)),
    NameRule((OpClass.DOWN,), substrings=("down_proj",)),
    # Attention before GEMMs: FlashAttention / FMHA kernels carry cutlass and sm90 in their names.
    NameRule((OpClass.ATTN,), substrings=("flash", "fmha", "attention", "attn", "softmax", "sdpa", "scaled_dot")),
    NameRule((OpClass.ACCEPT,), substrings=("argmax", "accept")),
    # Rotary before embedding: vLLM-style rotary kernels are named rotary_embedding_kernel.
    NameRule((OpClass.ROPE_KV,), substrings=("rotary", "index_copy", "indexcopy", "indexfunc", "scatter", "kv_cache"),
             words=("rope", "cat", "neg")),
    NameRule((OpClass.EMBED,), substrings=("embedding", "indexselect", "index_select")),
    NameRule((OpClass.NORM,), substrings=("rmsnorm", "rms_norm", "layernorm", "layer_norm", "rsqrt"),
             words=("rms", "norm", "mean", "pow")),
    NameRule((OpClass.ACT,), substrings=("silu", "swiglu", "gelu"), words=("mul",)),
    NameRule(LINEAR_OPS, substrings=("gemm", "gemv", "cutlass", "ampere", "sm90", "sm80", "xmma", "cublas",
                                     "nvjet", "matmul", "splitk"), words=("mm", "bmm", "addmm")),
)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_NON_WORD = re.compile(r"[^A-Za-z0-9]+")


def name_words(name: str) -> frozenset[str]:
    """Lower-cased words of a kernel name, split at punctuation and camelCase ("CatArrayBatchedCopy" -> cat, ...)."""
    words = set()
    for chunk in _NON_WORD.split(name):
        for word in _CAMEL.split(chunk):
            if word:
                words.add(word.lower())
    return frozenset(words)


def classify_kernel(name: str) -> tuple[OpClass, ...]:
    """The op classes a kernel's time belongs to: one when its name identifies the op, all the linear
    classes for a GEMM shared by every linear layer, (OpClass.OTHER,) when nothing matches."""
    lowered = name.lower()
    words = name_words(name)
    for rule in RULES:
        if rule.matches(lowered, words):
            return rule.ops
    return (OpClass.OTHER,)


def short_kernel_name(name: str, limit: int = 60) -> str:
    """A kernel name cut to `limit` characters for reports (templated C++ names run to hundreds)."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def kernel_op_classes(name: str, recorded_op: str) -> tuple[OpClass, ...]:
    """Trust the op class the profiler recorded when it names one; otherwise classify by the kernel's name."""
    try:
        op = OpClass(recorded_op)
    except ValueError:
        return classify_kernel(name)
    return classify_kernel(name) if op is OpClass.OTHER else (op,)


# Kernels the fused Llama forward (engines/fused.py) launches in several roles, and their roles in launch order per
# forward of `layers` layers: the norm + projection kernel runs QKV and gate_up in each layer, then the LM head; the
# plain projection kernel o_proj and down. Names alone cannot split their time between those op classes.
FUSED_ROLES: dict[str, Callable[[int], list[OpClass]]] = {
    "rmsnorm_linear_kernel": lambda layers: [OpClass.QKV, OpClass.GATE_UP] * layers + [OpClass.LM_HEAD],
    "linear_kernel": lambda layers: [OpClass.O_PROJ, OpClass.DOWN] * layers,
}


def _role_key(name: str) -> str | None:
    lowered = name.lower()
    return next((k for k in FUSED_ROLES if k in lowered and not (k == "linear_kernel" and "rmsnorm" in lowered)), None)


def label_fused_launches(names: Sequence[str], layers: int) -> list[OpClass | None] | None:
    """Per launch (kernel names in launch order over whole forwards): its op class for a kernel FUSED_ROLES names,
    None for the others. None in all when some such kernel's launches are not whole forwards of `layers` layers
    (another forward, a partial profile): the caller then attributes by name."""
    if layers < 1:
        return None
    keys = [_role_key(n) for n in names]
    counts = {k: keys.count(k) for k in FUSED_ROLES}
    forwards = {k: counts[k] // len(FUSED_ROLES[k](layers)) for k in FUSED_ROLES}
    if any(counts[k] % len(FUSED_ROLES[k](layers)) for k in FUSED_ROLES) or len(set(forwards.values())) != 1 \
            or not next(iter(forwards.values())):
        return None
    seen = dict.fromkeys(FUSED_ROLES, 0)
    labels: list[OpClass | None] = []
    for k in keys:
        if k is None:
            labels.append(None)
            continue
        roles = FUSED_ROLES[k](layers)
        labels.append(roles[seen[k] % len(roles)])
        seen[k] += 1
    return labels
