"""The catalog's search space as Optuna parameters: one parameter per (mechanism, knob), plus the drafter choice.

`suggest` turns a trial into an EngineConfig, drafter label and (batch regime) BatchConfig (define-by-run),
`params_of` finds the parameters that reproduce a measured build (so the search proposer can seed its study with
candidates measured before), and `distributions` names each parameter's domain.
"""
from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from specpilot.deployments import Deployment
from specpilot.engines.batch.config import BatchConfig, DraftLength, VerifyBudget
from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.stages.batch_catalog import apply_batch_delta
from specpilot.stages.candidate import Candidate
from specpilot.stages.catalog import (DRAFTER_PARAM, CatalogMechanism, Knob, KnobDomain, KnobTarget, SearchSpace,
                                      apply_delta)


def _param(m: CatalogMechanism, k: Knob) -> str:
    return f"{m.name}.{k.field}"


def distributions(space: SearchSpace, label: str) -> dict[str, BaseDistribution]:
    out: dict[str, BaseDistribution] = {}
    if len(space.drafter_labels) > 1:
        out[DRAFTER_PARAM] = CategoricalDistribution(space.drafter_labels)
    for m in space.mechanisms[label]:
        for k in m.knobs:
            out[_param(m, k)] = (IntDistribution(k.low, k.high) if k.domain is KnobDomain.INT
                                 else CategoricalDistribution(k.choices))
    return out


def _repaired(start: EngineConfig, values: dict[str, Any]) -> EngineConfig:
    """Apply knob values, pulling dependent knobs inside their limits (min <= max, kept nodes <= budget)."""
    merged = {**start.to_dict(), **values}
    merged["ngram_min"] = min(merged["ngram_min"], merged["ngram_max"])
    merged["level_one_keep"] = min(merged["level_one_keep"], merged["tree_budget"])
    return start.replace(**{k: merged[k] for k in values.keys() | {"ngram_min", "level_one_keep"}})


def _repaired_batch(dep: Deployment, base: BatchConfig | None, values: dict[str, Any]) -> BatchConfig | None:
    """Apply BatchConfig knob values; a knob its mechanism's switch leaves unread (max_draft_len under a fixed draft
    length, verify_budget_max without a budget) is pinned to the base's value, so one build is measured once."""
    start = apply_batch_delta(dep, base, {})
    if start is None:
        return None
    merged = {**start.to_dict(), **values}
    if DraftLength(merged["draft_length"]) is DraftLength.FIXED:
        merged["max_draft_len"] = start.max_draft_len
    if VerifyBudget(merged["verify_budget"]) is VerifyBudget.OFF:
        merged["verify_budget_max"] = start.verify_budget_max
    return apply_batch_delta(dep, start, {k: merged[k] for k in values})


def suggest(trial: optuna.Trial | optuna.trial.FixedTrial, dep: Deployment, base: Candidate,
            space: SearchSpace) -> tuple[EngineConfig, str, BatchConfig | None]:
    """A trial's config, drafter label and BatchConfig (None in the single regime; define-by-run: each drafter's
    knobs only when it is chosen)."""
    labels = space.drafter_labels
    label = trial.suggest_categorical(DRAFTER_PARAM, list(labels)) if len(labels) > 1 else labels[0]
    values: dict[KnobTarget, dict[str, Any]] = {t: {} for t in KnobTarget}
    for m in space.mechanisms[label]:
        for k in m.knobs:
            name = _param(m, k)
            values[k.target][k.field] = (trial.suggest_int(name, k.low, k.high) if k.domain is KnobDomain.INT
                                         else trial.suggest_categorical(name, list(k.choices)))
    start, label = apply_delta(dep, base, {}, label)
    return (_repaired(start, values[KnobTarget.ENGINE]), label,
            _repaired_batch(dep, base.batch_config, values[KnobTarget.BATCH]))


def params_of(config: EngineConfig, label: str | None, dep: Deployment, base: Candidate, space: SearchSpace,
              batch: BatchConfig | None = None) -> dict[str, Any] | None:
    """The trial parameters that reproduce `config` (and `batch`) exactly, or None when the space cannot."""
    if label not in space.mechanisms:
        return None
    params: dict[str, Any] = {DRAFTER_PARAM: label} if len(space.drafter_labels) > 1 else {}
    as_dict = {KnobTarget.ENGINE: config.to_dict(), KnobTarget.BATCH: batch.to_dict() if batch is not None else {}}
    for m in space.mechanisms[label]:
        for k in m.knobs:
            if k.field not in as_dict[k.target]:
                return None  # a batching knob, and no BatchConfig to read it from
            value = as_dict[k.target][k.field]
            inside = k.low <= value <= k.high if k.domain is KnobDomain.INT else value in k.choices
            if not inside:
                return None
            params[_param(m, k)] = value
    try:
        rebuilt, rebuilt_label, rebuilt_batch = suggest(optuna.trial.FixedTrial(params), dep, base, space)
    except (ValueError, ConfigError):
        return None
    same_batch = (rebuilt_batch.digest() if rebuilt_batch else None) == (batch.digest() if batch else None)
    return params if rebuilt.digest() == config.digest() and rebuilt_label == label and same_batch else None
