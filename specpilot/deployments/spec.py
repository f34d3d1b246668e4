"""The Deployment dataclasses and their parsing from YAML data, with errors that name the field.

A deployment is a target model, its drafters, a device, a regime, a workload and base engine settings.
Every class validates itself on construction and raises DeploymentError(field, problem); the loader adds
the file name. See the package docstring for the YAML schema.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from specpilot.engines.config import ConfigError, DrafterKind, EngineConfig
from specpilot.testbed.registry import TestbedName
from specpilot.testbed.synthetic import ShapeName
from specpilot.workload import ALL_BENCHMARKS, WorkloadError, WorkloadSpec

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class DeploymentError(ValueError):
    """A deployment value is invalid. `field` is a dotted path (`drafters[1].model`); `source` the file."""

    def __init__(self, field: str, problem: str, source: str | Path | None = None) -> None:
        self.field, self.problem, self.source = field, problem, source
        where = f"{source}: " if source is not None else ""
        super().__init__(f"{where}{field}: {problem}" if field else f"{where}{problem}")

    def within(self, prefix: str) -> "DeploymentError":
        joined = prefix if not self.field else (f"{prefix}{self.field}" if self.field.startswith("[") else f"{prefix}.{self.field}")
        return DeploymentError(joined, self.problem, self.source)

    def located(self, source: str | Path) -> "DeploymentError":
        return DeploymentError(self.field, self.problem, source)


class ModelRefKind(str, Enum):
    TESTBED = "testbed"  # a testbed name, fetched/derived into the cache on demand
    PATH = "path"  # a model directory
    RANDOM = "random"  # a random-weight model of a named shape, generated in memory by the engine


class DeviceKind(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"


class RegimeKind(str, Enum):
    SINGLE = "single"  # one request at a time
    BATCH = "batch"  # concurrent requests at each listed concurrency, served by the batched engine


class Arrival(str, Enum):
    """How a batch regime's requests arrive (specpilot.bench.batched reads it too)."""
    ALL = "all"  # every request at t=0; the scheduler keeps `concurrency` of them running
    POISSON = "poisson"  # exponential inter-arrival times at `rate` requests per second


@dataclass(frozen=True)
class ModelRef:
    kind: ModelRefKind
    value: str
    seed: int | None = None  # random refs only

    def __post_init__(self) -> None:
        kind = _enum(ModelRefKind, self.kind, "")
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.value, str) or not self.value:
            raise DeploymentError(kind.value, f"expected a non-empty string, got {self.value!r}")
        try:
            if kind is ModelRefKind.TESTBED:
                TestbedName.parse(self.value)
            elif kind is ModelRefKind.RANDOM:
                ShapeName(self.value)
        except ValueError as e:
            choices = f"; expected one of {[s.value for s in ShapeName]}" if kind is ModelRefKind.RANDOM else ""
            raise DeploymentError(kind.value, f"{e}{choices}") from None
        if kind is ModelRefKind.RANDOM:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
                raise DeploymentError("seed", f"a random model needs a non-negative integer seed, got {self.seed!r}")
        elif self.seed is not None:
            raise DeploymentError("seed", f"only random models take a seed ({kind.value} models are fixed files)")

    @classmethod
    def from_yaml(cls, data: Any, base_dir: Path | None = None) -> "ModelRef":
        m = _mapping(data, "", "a model reference like {testbed: smollm2-135m}, {path: DIR} or {random: llama3-8b, seed: 0}")
        kinds = [k for k in ModelRefKind if k.value in m]
        if len(kinds) != 1:
            raise DeploymentError("", f"expected exactly one of {[k.value for k in ModelRefKind]}, got keys {sorted(m)}")
        kind = kinds[0]
        _no_extra(m, {kind.value, "seed"} if kind is ModelRefKind.RANDOM else {kind.value})
        value = m[kind.value]
        if kind is ModelRefKind.PATH and isinstance(value, str) and value:
            p = Path(value).expanduser()
            value = str(p if p.is_absolute() or base_dir is None else (base_dir / p).resolve())
        return cls(kind, value, m.get("seed", 0 if kind is ModelRefKind.RANDOM else None))

    def to_dict(self) -> dict[str, Any]:
        return {self.kind.value: self.value, **({"seed": self.seed} if self.seed is not None else {})}

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.value}" + (f"@{self.seed}" if self.seed is not None else "")


@dataclass(frozen=True)
class DrafterSpec:
    kind: DrafterKind
    model: ModelRef | None = None  # draft_model: the draft model; block: its checkpoint
    engine: tuple[tuple[str, Any], ...] = ()  # EngineConfig overrides for this drafter (e.g. draft_len)

    def __post_init__(self) -> None:
        kind = _enum(DrafterKind, self.kind, "kind")
        object.__setattr__(self, "kind", kind)
        if kind is DrafterKind.NONE:
            raise DeploymentError("kind", "'none' is the autoregressive baseline, which every run measures; list drafters only")
        needs_model = kind in (DrafterKind.DRAFT_MODEL, DrafterKind.BLOCK)
        if needs_model and self.model is None:
            raise DeploymentError("model", f"a {kind.value} drafter needs a model reference")
        if not needs_model and self.model is not None:
            raise DeploymentError("model", f"a {kind.value} drafter takes no model")
        overrides = dict(self.engine)
        if "drafter" in overrides:
            raise DeploymentError("engine.drafter", "the drafter kind is set by `kind`")
        _engine_config(overrides, "engine", base=EngineConfig(drafter=kind))
        object.__setattr__(self, "engine", tuple(sorted(overrides.items())))

    @property
    def label(self) -> str:
        """kind[:model][{overrides}]: two drafters of one model (say chain and tree) stay apart in reports."""
        base = self.kind.value if self.model is None else f"{self.kind.value}:{self.model.value}"
        return base + ("{" + ",".join(f"{k}={v}" for k, v in self.engine) + "}" if self.engine else "")

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The deployment's base engine config with this drafter and its overrides applied."""
        return base.replace(drafter=self.kind, **dict(self.engine))

    @classmethod
    def from_yaml(cls, data: Any, base_dir: Path | None = None) -> "DrafterSpec":
        m = _mapping(data, "", "a drafter like {kind: ngram}")
        _no_extra(m, {"kind", "model", "engine"})
        if "kind" not in m:
            raise DeploymentError("kind", f"missing; expected one of {[k.value for k in DrafterKind if k is not DrafterKind.NONE]}")
        model = None
        if "model" in m:
            try:
                model = ModelRef.from_yaml(m["model"], base_dir)
            except DeploymentError as e:
                raise e.within("model") from None
        engine = _mapping(m.get("engine", {}), "engine", "a mapping of EngineConfig fields")
        return cls(m["kind"], model, tuple(engine.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, **({"model": self.model.to_dict()} if self.model else {}),
                **({"engine": dict(self.engine)} if self.engine else {})}


@dataclass(frozen=True)
class DeviceSpec:
    kind: DeviceKind
    gpu: str | None = None  # e.g. "H200"; cuda only
    count: int = 1

    def __post_init__(self) -> None:
        kind = _enum(DeviceKind, self.kind, "kind")
        object.__setattr__(self, "kind", kind)
        if isinstance(self.count, bool) or not isinstance(self.count, int) or not 1 <= self.count <= 64:
            raise DeploymentError("count", f"expected an integer in 1..64, got {self.count!r}")
        if kind is DeviceKind.CUDA and (not isinstance(self.gpu, str) or not self.gpu.strip()):
            raise DeploymentError("gpu", f"a cuda device needs a GPU name (e.g. H200), got {self.gpu!r}")
        if kind is DeviceKind.CPU and (self.gpu is not None or self.count != 1):
            raise DeploymentError("gpu" if self.gpu is not None else "count", "a cpu device takes no gpu and count 1")

    @classmethod
    def from_yaml(cls, data: Any) -> "DeviceSpec":
        m = _mapping(data, "", "a device like {kind: cuda, gpu: H200, count: 1}")
        _no_extra(m, {"kind", "gpu", "count"})
        if "kind" not in m:
            raise DeploymentError("kind", f"missing; expected one of {[k.value for k in DeviceKind]}")
        return cls(m["kind"], m.get("gpu"), m.get("count", 1))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "gpu": self.gpu, "count": self.count}


@dataclass(frozen=True)
class RegimeSpec:
    kind: RegimeKind = RegimeKind.SINGLE
    concurrency: tuple[int, ...] = ()  # batch only: the concurrencies measured
    arrival: Arrival | None = None  # batch only (default all): how requests arrive at each concurrency
    rate: float | None = None  # poisson only: requests per second (None: Little's law under AR, see bench.batched)

    def __post_init__(self) -> None:
        kind = _enum(RegimeKind, self.kind, "kind")
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.concurrency, (list, tuple)):
            raise DeploymentError("concurrency", f"expected a list of integers, got {self.concurrency!r}")
        conc = tuple(self.concurrency)
        object.__setattr__(self, "concurrency", conc)
        if kind is RegimeKind.SINGLE:
            for name in ("concurrency", "arrival", "rate"):
                if getattr(self, name) not in ((), None):
                    raise DeploymentError(name, f"the single regime runs one request at a time; drop {name} "
                                          "(or use kind: batch)")
            return
        if not conc or any(isinstance(c, bool) or not isinstance(c, int) or not 2 <= c <= 1024 for c in conc):
            raise DeploymentError("concurrency", f"the batch regime needs a list of integers in 2..1024 (the batched "
                                  f"engine's max_batch range), got {list(conc)}")
        if len(set(conc)) != len(conc):
            raise DeploymentError("concurrency", f"repeated values in {list(conc)}")
        arrival = Arrival.ALL if self.arrival is None else _enum(Arrival, self.arrival, "arrival")
        object.__setattr__(self, "arrival", arrival)
        if self.rate is not None:
            if arrival is not Arrival.POISSON:
                raise DeploymentError("rate", f"a rate paces poisson arrivals; arrival is {arrival.value!r}")
            if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0 < self.rate < 1e6:
                raise DeploymentError("rate", f"expected requests per second in (0, 1e6), got {self.rate!r}")
            object.__setattr__(self, "rate", float(self.rate))

    @property
    def label(self) -> str:
        """The regime as memory scopes name it: batch1 (one request at a time), batch16-20-24 (all at once),
        batch16-20-24-poisson[@rate]: measurements under other arrivals are not the same evidence."""
        if self.kind is RegimeKind.SINGLE:
            return "batch1"
        label = "batch" + "-".join(map(str, self.concurrency))
        if self.arrival is Arrival.POISSON:
            label += "-poisson" + ("" if self.rate is None else f"@{self.rate:g}")
        return label

    @classmethod
    def from_yaml(cls, data: Any) -> "RegimeSpec":
        m = _mapping(data, "", "a regime like {kind: single} or {kind: batch, concurrency: [16, 20, 24], "
                     "arrival: poisson, rate: 8}")
        _no_extra(m, {"kind", "concurrency", "arrival", "rate"})
        return cls(m.get("kind", RegimeKind.SINGLE), m.get("concurrency", ()), m.get("arrival"), m.get("rate"))

    def to_dict(self) -> dict[str, Any]:
        if self.kind is RegimeKind.SINGLE:  # no arrival keys: single deployments keep their fingerprints
            return {"kind": self.kind.value, "concurrency": []}
        return {"kind": self.kind.value, "concurrency": list(self.concurrency), "arrival": self.arrival.value,
                "rate": self.rate}


def workload_from_yaml(data: Any) -> WorkloadSpec:
    m = _mapping(data, "", "a workload mapping")
    names = {"benchmarks", "prompts_per_benchmark", "max_new_tokens", "tune_fraction", "validate_fraction", "seed"}
    _no_extra(m, names)
    for key in ("prompts_per_benchmark", "max_new_tokens"):
        if key not in m:
            raise DeploymentError(key, "missing (required)")
    if "benchmarks" in m and not isinstance(m["benchmarks"], list):
        raise DeploymentError("benchmarks", f"expected a list of benchmark names, got {m['benchmarks']!r}")
    try:
        return WorkloadSpec(**{**m, "benchmarks": tuple(m.get("benchmarks", ALL_BENCHMARKS))})
    except WorkloadError as e:
        raise DeploymentError(_leading_field(str(e)), str(e)) from None


def _engine_config(overrides: dict[str, Any], where: str, base: EngineConfig | None = None) -> EngineConfig:
    known = set(EngineConfig.__dataclass_fields__)
    for key in overrides:
        if key not in known:
            raise DeploymentError(f"{where}.{key}", f"unknown EngineConfig field; known: {sorted(known)}")
    try:
        return (base or EngineConfig()).replace(**overrides)
    except (ConfigError, TypeError) as e:
        name = _leading_field(str(e))
        raise DeploymentError(f"{where}.{name}" if name in known else where, str(e)) from None


def _leading_field(message: str) -> str:
    m = re.match(r"^(\w+)[=:]", message)
    return m.group(1) if m else ""


def _enum(enum: type[Enum], value: Any, field_name: str) -> Any:
    try:
        return enum(value)
    except ValueError:
        raise DeploymentError(field_name, f"{value!r} is not one of {[e.value for e in enum]}") from None


def _mapping(data: Any, field_name: str, expected: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise DeploymentError(field_name, f"expected {expected}, got {data!r}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise DeploymentError(field_name, f"keys must be strings, got {bad}")
    return dict(data)


def _no_extra(m: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(m) - allowed)
    if extra:
        raise DeploymentError(extra[0], f"unknown field; allowed here: {sorted(allowed)}")
