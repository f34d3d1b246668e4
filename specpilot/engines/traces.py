"""Trace records the engine emits and the profile stage writes as parquet; the cost model reads them.

One StepTrace per verify step (speculative) or decode step (AR). The drafter's recorded distributions and
the target's actual continuation make exact replay possible: the cost model rebuilds the best-first tree a
perfect tree-shaper would have verified and counts what it would have accepted.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pyarrow as pa


@dataclass
class StepTrace:
    request_id: str
    step: int
    position: int  # sequence length before this step (committed tokens)
    drafted: int  # draft nodes verified this step (0 for AR)
    depth: int  # deepest draft node (== drafted for a chain)
    accepted: int  # draft tokens accepted (excluding the bonus token)
    committed: int  # tokens appended this step (accepted + bonus, after EOS / max-token truncation)
    verify_tokens: int  # tokens in the target forward (1 + drafted, before tiling)
    draft_s: float  # host wall time spent drafting
    verify_s: float  # wall time of the target forward + acceptance (includes the one host sync)
    # Drafter's per-depth candidates along its proposal: topk_tokens[d] / topk_probs[d] list the drafter's
    # best guesses for depth d+1 (probabilities; n-gram uses normalised match counts).
    topk_tokens: list[list[int]] = field(default_factory=list)
    topk_probs: list[list[float]] = field(default_factory=list)
    # The target's actual continuation from `position` (filled in after the request ends from its output).
    target_tokens: list[int] = field(default_factory=list)


STEP_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("step", pa.int32()),
    ("position", pa.int32()),
    ("drafted", pa.int32()),
    ("depth", pa.int32()),
    ("accepted", pa.int32()),
    ("committed", pa.int32()),
    ("verify_tokens", pa.int32()),
    ("draft_s", pa.float64()),
    ("verify_s", pa.float64()),
    ("topk_tokens", pa.list_(pa.list_(pa.int32()))),
    ("topk_probs", pa.list_(pa.list_(pa.float32()))),
    ("target_tokens", pa.list_(pa.int32())),
])


@dataclass
class RequestTrace:
    request_id: str
    benchmark: str
    mode: str  # "ar" or "spec"
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float  # wall time from first decode step to the last token
    steps: int
    stop_reason: str  # "eos" or "max_tokens"


REQUEST_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("benchmark", pa.string()),
    ("mode", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("new_tokens", pa.int32()),
    ("prefill_s", pa.float64()),
    ("decode_s", pa.float64()),
    ("steps", pa.int32()),
    ("stop_reason", pa.string()),
])


@dataclass
class KernelTrace:
    name: str  # kernel name as the profiler reports it
    op: str  # op class it belongs to (see specpilot.engines.shapes.OpClass), "other" if unknown
    calls: int
    device_s: float  # total device time over the profiled steps
    steps: int  # profiled steps the totals cover
    tokens: int  # tokens per profiled forward (the verify width)


KERNEL_SCHEMA = pa.schema([
    ("name", pa.string()),
    ("op", pa.string()),
    ("calls", pa.int64()),
    ("device_s", pa.float64()),
    ("steps", pa.int32()),
    ("tokens", pa.int32()),
])


def to_table(rows: list, schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist([asdict(r) for r in rows], schema=schema)
