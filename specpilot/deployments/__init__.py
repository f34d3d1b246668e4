"""Deployments: one YAML file each in this directory, loaded into a validated, frozen `Deployment`.

YAML schema (fields marked * are required):

    name*: smollm2-135m-cpu            # lowercase; equals the file name for files shipped here
    description: free text
    target*: {testbed: smollm2-135m}   # or {path: DIR} (relative to the YAML file) or {random: llama3-8b, seed: 0}
    drafters*:                         # at least one; the autoregressive baseline is always measured
      - kind: ngram                    # ngram | draft_model | block
        engine: {draft_len: 5}         # optional EngineConfig overrides for this drafter
      - kind: draft_model
        model: {testbed: smollm2-135m-l6}   # first 6 layers of the target; or {path: DIR}
    device*: {kind: cuda, gpu: H200, count: 1}   # or {kind: cpu}
    regime: {kind: single}             # or {kind: batch, concurrency: [16, 20, 24], arrival: all}
                                       # (arrival: all | poisson; poisson takes an optional rate, requests/s).
                                       # The batch regime is served by the batched engine: n-gram drafters,
                                       # chain verification, kernel_backend: triton (on cpu: the Triton
                                       # interpreter, TRITON_INTERPRET=1)
    workload*:
      benchmarks: [gsm8k, humaneval, math500, mbpp, mt_bench]   # default: all five
      prompts_per_benchmark*: 2        # tune prompts per benchmark, and as many validate prompts
      max_new_tokens*: 64
      tune_fraction: 0.5               # tune pool share of each benchmark
      validate_fraction: 0.5           # validate pool share (disjoint from the tune pool)
      seed: 0
    engine: {dtype: bfloat16}          # base EngineConfig overrides (every field but `drafter`)
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import specpilot
from specpilot.deployments.spec import (_NAME, Arrival, DeploymentError, DeviceKind, DeviceSpec, DrafterSpec,
                                        ModelRef, ModelRefKind, RegimeKind, RegimeSpec, _engine_config, _mapping,
                                        _no_extra, workload_from_yaml)
from specpilot.engines.config import DrafterKind, EngineConfig, KernelBackend, VerifyMode
from specpilot.engines.family import FamilyLookupError, TargetFamily, family_of_dir
from specpilot.engines.shapes import UnsupportedModelError
from specpilot.testbed.modeldir import check_model_dir, model_identity
from specpilot.testbed.registry import TestbedName, resolve_testbed
from specpilot.testbed.synthetic import ShapeName
from specpilot.workload import WorkloadSpec

DEPLOYMENTS_DIR = Path(__file__).resolve().parent
_CODE_DIRS = ("engines", "kernels")  # the code whose change invalidates measurements

__all__ = ["DEPLOYMENTS_DIR", "Arrival", "Deployment", "DeploymentError", "DeviceKind", "DeviceSpec", "DrafterSpec",
           "ModelRef", "ModelRefKind", "RegimeKind", "RegimeSpec", "WorkloadSpec", "engine_code_version",
           "list_deployments", "load_deployment", "model_fingerprint", "resolve_model"]


@dataclass(frozen=True)
class Deployment:
    name: str
    target: ModelRef
    drafters: tuple[DrafterSpec, ...]
    device: DeviceSpec
    workload: WorkloadSpec
    regime: RegimeSpec = RegimeSpec()
    engine: EngineConfig = EngineConfig()  # the base config; each drafter applies its kind and overrides
    description: str = ""
    source: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise DeploymentError("name", f"{self.name!r}: use lowercase letters, digits, '.', '_' and '-'")
        object.__setattr__(self, "drafters", tuple(self.drafters))
        if not self.drafters:
            raise DeploymentError("drafters", "list at least one drafter")
        labels = [d.label for d in self.drafters]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise DeploymentError(f"drafters[{i}]", f"drafter {label} is listed twice")
        if self.device.kind is DeviceKind.CPU:
            # The batched engine runs only the Triton kernels; on cpu, under the Triton interpreter (development).
            triton_on_cpu = self.engine.kernel_backend is KernelBackend.TRITON and not self.batched
            for name, bad in (("cuda_graphs", self.engine.cuda_graphs), ("compile", self.engine.compile),
                              ("kernel_backend", triton_on_cpu)):
                if bad:
                    raise DeploymentError(f"engine.{name}", f"{getattr(self.engine, name)!r} needs a cuda device "
                                          "(this deployment runs on cpu)")
        if self.workload.max_new_tokens + self.engine.token_tile >= self.engine.max_seq_len:
            raise DeploymentError("workload.max_new_tokens", f"{self.workload.max_new_tokens} new tokens leave no room "
                                  f"for prompts within engine.max_seq_len={self.engine.max_seq_len}")
        for i, d in enumerate(self.drafters):
            try:
                d.engine_config(self.engine)
            except ValueError as e:
                raise DeploymentError(f"drafters[{i}].engine", f"conflicts with the base engine config: {e}") from None
        self._check_family()
        if self.batched:
            self._check_batched()

    @property
    def batched(self) -> bool:
        """Served by the batched engine (specpilot.engines.batch): the batch regime."""
        return self.regime.kind is RegimeKind.BATCH

    def _check_batched(self) -> None:
        """What the batched engine serves: Llama targets, n-gram drafters verified as chains, Triton kernels (its
        batch-invariant kernels are what makes every request equal its single-request AR output)."""
        if self.engine.kernel_backend is not KernelBackend.TRITON:
            raise DeploymentError("engine.kernel_backend", "the batch regime is served by the batched engine, whose "
                                  "batch-invariant kernels are Triton's: set kernel_backend: triton (on cpu they run "
                                  "under the Triton interpreter, TRITON_INTERPRET=1)")
        for i, (d, cfg) in enumerate(zip(self.drafters, self.drafter_configs().values())):
            if d.kind is not DrafterKind.NGRAM:
                raise DeploymentError(f"drafters[{i}].kind", f"the batched engine drafts by n-gram lookup only; "
                                      f"{d.kind.value} drafters serve the single regime")
            if cfg.verify is not VerifyMode.CHAIN:
                raise DeploymentError(f"drafters[{i}].engine.verify", "the batched engine verifies chains only")
        try:
            family = self.target_family()
        except (FamilyLookupError, UnsupportedModelError, OSError):
            return  # a directory that cannot be read yet: the session checks it when it loads the model
        if family is not TargetFamily.LLAMA:
            raise DeploymentError("regime.kind", f"the batched engine serves Llama-family targets; this target is "
                                  f"{family.value}")

    def target_family(self) -> TargetFamily:
        """The target's family without loading it: random shapes and testbed bases know theirs; a model directory
        says it in its config.json."""
        ref = self.target
        if ref.kind is ModelRefKind.RANDOM:
            return ShapeName(ref.value).family
        if ref.kind is ModelRefKind.TESTBED:
            return TestbedName.parse(ref.value).base.family
        return family_of_dir(ref.value)

    def _check_family(self) -> None:
        """Hybrid targets run n-gram and draft-model drafters, chain or tree verified (not block drafters, which read
        Llama target features, nor two-level verification). A directory that cannot be read yet is checked when the
        session loads it."""
        try:
            family = self.target_family()
        except (FamilyLookupError, UnsupportedModelError, OSError):
            return
        if family is not TargetFamily.HYBRID:
            return
        for i, (d, cfg) in enumerate(zip(self.drafters, self.drafter_configs().values())):
            if d.kind is DrafterKind.BLOCK:
                raise DeploymentError(f"drafters[{i}].kind", "block drafters read Llama target features: not available "
                                      "on hybrid targets (use ngram or draft_model)")
            if cfg.verify is VerifyMode.TWO_LEVEL:
                raise DeploymentError(f"drafters[{i}].engine.verify", "two_level is not available on hybrid targets")

    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | None = None, source: Path | None = None) -> "Deployment":
        m = _mapping(data, "", "a mapping at the top level")
        _no_extra(m, {"name", "description", "target", "drafters", "device", "regime", "workload", "engine"})
        for key in ("name", "target", "drafters", "device", "workload"):
            if key not in m:
                raise DeploymentError(key, "missing (required)")
        target = _within("target", lambda: ModelRef.from_yaml(m["target"], base_dir))
        if not isinstance(m["drafters"], list):
            raise DeploymentError("drafters", f"expected a list of drafters, got {m['drafters']!r}")
        drafters = tuple(_within(f"drafters[{i}]", lambda d=d: DrafterSpec.from_yaml(d, base_dir))
                         for i, d in enumerate(m["drafters"]))
        overrides = _mapping(m.get("engine", {}), "engine", "a mapping of EngineConfig fields")
        if "drafter" in overrides:
            raise DeploymentError("engine.drafter", "set drafters under `drafters:`, not in the base engine config")
        description = m.get("description", "")
        if not isinstance(description, str):
            raise DeploymentError("description", f"expected a string, got {description!r}")
        return cls(name=m["name"], target=target, drafters=drafters,
                   device=_within("device", lambda: DeviceSpec.from_yaml(m["device"])),
                   workload=_within("workload", lambda: workload_from_yaml(m["workload"])),
                   regime=_within("regime", lambda: RegimeSpec.from_yaml(m.get("regime", {"kind": "single"}))),
                   engine=_engine_config(overrides, "engine"), description=description, source=source)

    def drafter_configs(self) -> dict[str, EngineConfig]:
        """label -> the engine config of each drafter (base config + the drafter's kind and overrides)."""
        return {d.label: d.engine_config(self.engine) for d in self.drafters}

    def ar_config(self) -> EngineConfig:
        """The autoregressive baseline: the base config without a drafter."""
        return self.engine.replace(drafter=DrafterKind.NONE, verify=VerifyMode.CHAIN)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "target": self.target.to_dict(),
                "drafters": [d.to_dict() for d in self.drafters], "device": self.device.to_dict(),
                "regime": self.regime.to_dict(), "workload": self.workload.to_dict(),
                "engine": {k: v for k, v in self.engine.to_dict().items() if k != "drafter"}}

    def fingerprint(self, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """What a measurement of this deployment depends on: model and drafter identity, GPU, engine code.

        Testbed and path models are identified by the sha256 of config.json and of the weights (index),
        random ones by shape and seed. Testbed models are fetched if needed.
        """
        return {
            "deployment": self.name,
            "target": model_fingerprint(self.target, cache_dir),
            "drafters": [{"kind": d.kind.value, "engine": dict(d.engine),
                          "model": model_fingerprint(d.model, cache_dir) if d.model else None} for d in self.drafters],
            "device": self.device.to_dict(),
            "regime": self.regime.to_dict(),
            "workload": self.workload.to_dict(),
            "engine_config": self.engine.digest(),
            "engine_code": engine_code_version(),
        }

    def fingerprint_digest(self, cache_dir: str | os.PathLike[str] | None = None) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint(cache_dir), sort_keys=True).encode()).hexdigest()[:16]


def _within(prefix: str, build):
    try:
        return build()
    except DeploymentError as e:
        raise e.within(prefix) from None


def list_deployments() -> list[str]:
    """Names of the deployments shipped in this package."""
    return sorted(p.stem for p in DEPLOYMENTS_DIR.glob("*.yaml"))


def load_deployment(name_or_path: str | os.PathLike[str]) -> Deployment:
    """Load a shipped deployment by name, or any deployment YAML by path."""
    given = str(name_or_path)
    shipped = DEPLOYMENTS_DIR / f"{given}.yaml"
    if os.sep not in given and not given.endswith((".yaml", ".yml")):
        if not shipped.is_file():
            raise DeploymentError("", f"unknown deployment {given!r}; shipped: {list_deployments()} (or pass a path to a YAML file)")
        path = shipped
    else:
        path = Path(given).expanduser()
        if not path.is_file():
            raise DeploymentError("", f"deployment file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise DeploymentError("", f"invalid YAML: {e}", path) from None
    try:
        dep = Deployment.from_dict(data, base_dir=path.resolve().parent, source=path)
    except DeploymentError as e:
        raise e.located(path) from None
    if path.resolve().parent == DEPLOYMENTS_DIR and dep.name != path.stem:
        raise DeploymentError("name", f"{dep.name!r} must equal the file name {path.stem!r}", path)
    return dep


def resolve_model(ref: ModelRef, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The model directory of a reference (testbed models are fetched or derived on demand); None for random."""
    if ref.kind is ModelRefKind.RANDOM:
        return None
    if ref.kind is ModelRefKind.TESTBED:
        return resolve_testbed(ref.value, cache_dir)
    return check_model_dir(ref.value)


def model_fingerprint(ref: ModelRef, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    if ref.kind is ModelRefKind.RANDOM:
        return {"random": ref.value, "seed": ref.seed}
    path = resolve_model(ref, cache_dir)
    return {ref.kind.value: ref.value, **model_identity(path)}  # type: ignore[arg-type]


def engine_code_version() -> dict[str, str]:
    """specpilot's version and the sha256 of the engine and kernel sources."""
    root = Path(specpilot.__file__).resolve().parent
    h = hashlib.sha256()
    for sub in _CODE_DIRS:
        for p in sorted((root / sub).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return {"version": specpilot.__version__, "sources_sha256": h.hexdigest()[:16]}
