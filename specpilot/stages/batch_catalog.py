"""The batch regime's side of the catalog: the stock BatchConfig and BatchConfig deltas.

A batch-regime deployment is served by the batched engine (specpilot.engines.batch), so each of its builds is an
EngineConfig plus a BatchConfig (Candidate.batch_config). Stock is every batching mechanism off, sized for the
deployment's highest concurrency. Deltas over stock are what memory stores: EngineConfig fields at the top level,
BatchConfig fields nested under BATCH_DELTA ({"draft_len": 8, "batch": {"draft_length": "goodput"}}), so a
single-regime deployment can tell a batching mechanism from one of its own and never applies it.
"""
from __future__ import annotations

from typing import Any

from specpilot.deployments import Deployment
from specpilot.engines.batch.config import BatchConfig

BATCH_DELTA = "batch"  # the key under which a delta's BatchConfig fields nest
_SIZING = ("max_batch", "prefill_chunk", "graph_max_tokens", "num_pages", "cost_curve")  # the deployment's, not a
# mechanism's: the bench sizes every engine for the concurrency it runs at, and measures the cost curve itself


def stock_batch(dep: Deployment) -> BatchConfig | None:
    """None for the single regime; else every batching mechanism off, room for the highest concurrency."""
    if not dep.batched:
        return None
    return BatchConfig(max_batch=max(dep.regime.concurrency))


def batch_delta(base: BatchConfig | None, batch: BatchConfig | None) -> dict[str, Any]:
    """Fields of `batch` that differ from `base` (default: BatchConfig()), as JSON values, sizing left out."""
    if batch is None:
        return {}
    b, c = (base or BatchConfig()).to_dict(), batch.to_dict()
    return {k: c[k] for k in c if c[k] != b[k] and k not in _SIZING}


def split_delta(delta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(EngineConfig fields, BatchConfig fields) of a stored delta."""
    batch = delta.get(BATCH_DELTA) or {}
    if not isinstance(batch, dict):
        raise ValueError(f"{BATCH_DELTA!r} of a delta must be a mapping of BatchConfig fields, got {batch!r}")
    return {k: v for k, v in delta.items() if k != BATCH_DELTA}, dict(batch)


def apply_batch_delta(dep: Deployment, base: BatchConfig | None, delta: dict[str, Any]) -> BatchConfig | None:
    """`base` (default: the deployment's stock) with `delta` applied. A single-regime deployment takes no
    BatchConfig delta (ValueError): its engine has no batching mechanisms. ConfigError for unknown fields."""
    if not dep.batched:
        if delta:
            raise ValueError(f"deployment {dep.name} serves one request at a time: BatchConfig fields "
                             f"{sorted(delta)} apply to batch-regime deployments only")
        return None
    if any(k in _SIZING for k in delta):
        raise ValueError(f"BatchConfig sizing fields {sorted(k for k in delta if k in _SIZING)} are the deployment's, "
                         "not a mechanism's")
    return (base or stock_batch(dep)).replace(**delta)


def flat(delta: dict[str, Any]) -> dict[str, Any]:
    """A delta with its BatchConfig fields as `batch.<field>` keys: one flat namespace for merging and naming."""
    engine, batch = split_delta(delta)
    return {**engine, **{f"{BATCH_DELTA}.{k}": v for k, v in batch.items()}}


def nested(flat_delta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `flat`."""
    prefix = BATCH_DELTA + "."
    batch = {k[len(prefix):]: v for k, v in flat_delta.items() if k.startswith(prefix)}
    engine = {k: v for k, v in flat_delta.items() if not k.startswith(prefix)}
    return {**engine, **({BATCH_DELTA: batch} if batch else {})}
