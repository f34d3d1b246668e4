"""The catalog's search space as Optuna parameters: one parameter per (mechanism, knob), plus the drafter choice.

`suggest` turns a trial into an EngineConfig and drafter label (define-by-run), `params_of` finds the parameters
that reproduce a measured config (so the search proposer can seed its study with candidates measured before), and
`distributions` names each parameter's domain.
"""
from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from specpilot.deployments import Deployment
from specpilot.engines.config import ConfigError, EngineConfig
from specpilot.stages.candidate import Candidate
from specpilot.stages.catalog import DRAFTER_PARAM, CatalogMechanism, Knob, KnobDomain, SearchSpace, apply_delta


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


def suggest(trial: optuna.Trial | optuna.trial.FixedTrial, dep: Deployment, base: Candidate,
            space: SearchSpace) -> tuple[EngineConfig, str]:
    """A trial's config and drafter label (define-by-run: each drafter's knobs only when it is chosen)."""
    labels = space.drafter_labels
    label = trial.suggest_categorical(DRAFTER_PARAM, list(labels)) if len(labels) > 1 else labels[0]
    values: dict[str, Any] = {}
    for m in space.mechanisms[label]:
        for k in m.knobs:
            name = _param(m, k)
            values[k.field] = (trial.suggest_int(name, k.low, k.high) if k.domain is KnobDomain.INT
                               else trial.suggest_categorical(name, list(k.choices)))
    start, label = apply_delta(dep, base, {}, label)
    return _repaired(start, values), label


def params_of(config: EngineConfig, label: str | None, dep: Deployment, base: Candidate,
              space: SearchSpace) -> dict[str, Any] | None:
    """The trial parameters that reproduce `config` exactly, or None when the space cannot express it."""
    if label not in space.mechanisms:
        return None
    params: dict[str, Any] = {DRAFTER_PARAM: label} if len(space.drafter_labels) > 1 else {}
    as_dict = config.to_dict()
    for m in space.mechanisms[label]:
        for k in m.knobs:
            value = as_dict[k.field]
            inside = k.low <= value <= k.high if k.domain is KnobDomain.INT else value in k.choices
            if not inside:
                return None
            params[_param(m, k)] = value
    try:
        rebuilt, rebuilt_label = suggest(optuna.trial.FixedTrial(params), dep, base, space)
    except (ValueError, ConfigError):
        return None
    return params if rebuilt.digest() == config.digest() and rebuilt_label == label else None
