"""The stage framework: a request (input manifests + parameters) in, files + a sha256 manifest out.

Every stage is a plain function over typed inputs; its module also exposes `run(StageRun) -> dict` that reads
the request's input manifests, calls the function, and returns a JSON summary. `run_stage` wraps that: it
writes request.json, runs the stage, uploads every file of the output directory to the artifact store under
runs/<run_id>/<stage>[/<qualifier>...]/ and writes the stage manifest (sha256 per output) next to them.
The same path serves in-process calls (the Prefect flow) and `specpilot stage <name> --in M --out DIR`.
"""
from __future__ import annotations

import importlib
import io
import json
import re
import socket
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specpilot.artifacts import (
    MANIFEST_NAME, Manifest, digest_bytes, read_manifest, stage_prefix, store_from_uri, store_output,
    write_manifest,
)
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.deployments import (Deployment, ModelRefKind, engine_code_version, load_deployment,
                                  resolve_model)
from specpilot.engines.targets import read_target_shape
from specpilot.memory import Scope
from specpilot.stages.candidate import Candidate
from specpilot.stages.devices import default_device, device_name, on_device, session_for
from specpilot.testbed.synthetic import ShapeName
from specpilot.workload import Prompt

REQUEST_NAME = "request.json"


class StageName(str, Enum):
    RECALL = "recall"  # read memory (read-only) for mechanisms proven on similar scopes
    PROFILE = "profile"
    ATTRIBUTE = "attribute"
    EXPLORE = "explore"
    TUNE_KERNELS = "tune_kernels"  # GPU: launch parameters of the kernels furthest from their bound
    VALIDATE = "validate"
    INTEGRATE = "integrate"

    @property
    def entry(self) -> str:
        """module:function that runs this stage from a StageRun."""
        module = {StageName.RECALL: "explore", StageName.VALIDATE: "integrate"}.get(self, self.value)
        function = {StageName.RECALL: "run_recall", StageName.VALIDATE: "run_validate"}.get(self, "run")
        return f"specpilot.stages.{module}:{function}"


class SplitName(str, Enum):
    TUNE = "tune"  # what profile and explore may see
    VALIDATE = "validate"  # held out: validate and integrate only


@dataclass(frozen=True)
class StageRequest:
    """What a stage reads: upstream manifests by role, parameters, where to store, which device to use."""

    stage: StageName
    run_id: str
    deployment: str  # a shipped deployment name or a YAML path
    store: str  # artifact store URI
    inputs: dict[str, str] = field(default_factory=dict)  # role -> manifest URI
    params: dict[str, Any] = field(default_factory=dict)
    qualifiers: tuple[str, ...] = ()  # e.g. ("round1", "dev0")
    device: str = ""  # "cpu", "cuda:0", ...; empty: the deployment's device, index 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", StageName(self.stage))
        object.__setattr__(self, "qualifiers", tuple(self.qualifiers))
        stage_prefix(self.run_id, self.stage.value, *self.qualifiers)  # validates names
        json.dumps(self.params, allow_nan=False)

    @property
    def prefix(self) -> str:
        return stage_prefix(self.run_id, self.stage.value, *self.qualifiers)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage.value, "run_id": self.run_id, "deployment": self.deployment, "store": self.store,
                "inputs": dict(self.inputs), "params": self.params, "qualifiers": list(self.qualifiers),
                "device": self.device}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StageRequest":
        unknown = set(d) - {"stage", "run_id", "deployment", "store", "inputs", "params", "qualifiers", "device"}
        if unknown:
            raise ValueError(f"stage request: unknown field(s) {sorted(unknown)}")
        return cls(**{**d, "qualifiers": tuple(d.get("qualifiers", ()))})

    def save(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> "StageRequest":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise ValueError(f"{path}: not a stage request: {e}") from None


@dataclass(frozen=True)
class StageRun:
    """A request being executed: its store, output directory and accessors for its inputs."""

    request: StageRequest
    out_dir: Path

    @property
    def store(self):
        return store_from_uri(self.request.store)

    @property
    def deployment(self) -> Deployment:
        return load_deployment(self.request.deployment)

    @property
    def device(self) -> str:
        return self.request.device or default_device(self.deployment)

    @property
    def scratch(self) -> Path:
        """Local working files that are not outputs (outputs are flat files): e.g. sandbox runs, transcripts
        before they are flattened into outputs. Next to the output directory, created on first use."""
        path = self.out_dir.parent / f"{self.out_dir.name}.scratch"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def roles(self, prefix: str) -> list[str]:
        """Input roles named `prefix` or `prefix.<n>`, in order."""
        found = [r for r in self.request.inputs if r == prefix or r.startswith(prefix + ".")]
        return sorted(found, key=lambda r: (len(r), r))

    def manifest(self, role: str) -> Manifest:
        if role not in self.request.inputs:
            raise ValueError(f"stage {self.request.stage.value} needs input {role!r}; got {sorted(self.request.inputs)}")
        return read_manifest(self.store, self.request.inputs[role])

    def read_bytes(self, role: str, name: str) -> bytes:
        """An upstream output's bytes, checked against the sha256 its manifest recorded."""
        entry = self.manifest(role).output(name)
        data = self.store.get_bytes(entry.uri)
        if digest_bytes(data).sha256 != entry.sha256:
            raise ValueError(f"{entry.uri}: sha256 differs from its manifest's (corrupted or replaced artifact)")
        return data

    def read_json(self, role: str, name: str) -> Any:
        return json.loads(self.read_bytes(role, name))

    def read_table(self, role: str, name: str) -> pa.Table:
        return pq.read_table(io.BytesIO(self.read_bytes(role, name)))

    def session(self) -> DeploymentSession:
        return session_for(self.request.deployment, self.device)

    def prompts(self, split: SplitName, count: int) -> list[TokenizedPrompt]:
        return self.session().tokenize(select_prompts(self.deployment, split, count))

    def param(self, name: str, default: Any = None) -> Any:
        return self.request.params.get(name, default)


@dataclass(frozen=True)
class StageTiming:
    """When and where one stage ran (UTC ISO timestamps), kept in its manifest's meta as "timing": the
    record that shows, e.g., two explore tasks on two GPUs running at the same time."""

    started: str
    finished: str
    device: str
    host: str

    @property
    def seconds(self) -> float:
        return (datetime.fromisoformat(self.finished) - datetime.fromisoformat(self.started)).total_seconds()


@dataclass(frozen=True)
class StageOutcome:
    stage: StageName
    qualifiers: tuple[str, ...]
    manifest_uri: str
    out_dir: str  # local copy of the outputs and manifest.json
    meta: dict[str, Any]  # the stage's summary (also in its manifest)
    timing: StageTiming | None = None

    @property
    def label(self) -> str:
        return "-".join((self.stage.value, *self.qualifiers))

    def manifest(self) -> Manifest:
        return Manifest.load(Path(self.out_dir) / MANIFEST_NAME)


def run_stage(request: StageRequest, out_dir: str | Path) -> StageOutcome:
    """Run one stage and publish its outputs; returns the manifest URI and the stage's summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    request.save(out / REQUEST_NAME)
    module, function = request.stage.entry.split(":")
    run = StageRun(request, out)
    started = datetime.now(timezone.utc)
    with on_device(run.device):
        meta = getattr(importlib.import_module(module), function)(run)
    timing = StageTiming(started.isoformat(), datetime.now(timezone.utc).isoformat(), run.device, socket.gethostname())
    manifest_uri = publish(request, out, meta, timing)
    return StageOutcome(request.stage, request.qualifiers, manifest_uri, str(out), meta, timing)


def publish(request: StageRequest, out_dir: Path, meta: dict[str, Any], timing: StageTiming | None = None) -> str:
    """Upload every file of out_dir under the stage's prefix and write the manifest there (and locally)."""
    store = store_from_uri(request.store)
    subdirs = [p.name for p in out_dir.iterdir() if p.is_dir()]
    if subdirs:
        raise ValueError(f"stage {request.stage.value} wrote directories {subdirs} in {out_dir}; "
                         "outputs must be flat files")
    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    outputs = tuple(store_output(store, p.name, p, key=f"{request.prefix}/{p.name}") for p in files)
    manifest = Manifest.now(request.stage.value, request.run_id, inputs=tuple(request.inputs.values()),
                            outputs=outputs, meta={"request": request.to_dict(), "summary": meta,
                                                   **({"timing": asdict(timing)} if timing else {})})
    (out_dir / MANIFEST_NAME).write_text(manifest.to_json())
    return write_manifest(store, manifest, key=f"{request.prefix}/{MANIFEST_NAME}")


def path_part(name: str) -> str:
    """`name` usable as one segment of a store key (candidate names may contain ':')."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name).lstrip("-_.") or "unnamed"


def memory_scope(dep: Deployment, drafter_label: str | None, device: str) -> Scope:
    """Where a measurement of this deployment's build is proven: model family and model, drafter, device, regime."""
    target = dep.target
    shape = (ShapeName(target.value).shape if target.kind is ModelRefKind.RANDOM
             else read_target_shape(resolve_model(target)))
    model = Path(target.value).name if target.kind is ModelRefKind.PATH else target.value
    return Scope(shape.model_type, model, drafter_label or "none", device_name(device), dep.regime.label)


def select_prompts(dep: Deployment, split: SplitName, count: int) -> list[Prompt]:
    """The first `count` prompts of a split, taken round-robin over benchmarks (0 = all of them)."""
    chosen = dep.workload.select()
    pool = list(chosen.tune if split is SplitName.TUNE else chosen.validate)
    if count <= 0 or count >= len(pool):
        return pool
    by_bench: dict[str, list[Prompt]] = {}
    for p in pool:
        by_bench.setdefault(p.benchmark.value, []).append(p)
    out: list[Prompt] = []
    while len(out) < count:
        for prompts in by_bench.values():
            if prompts and len(out) < count:
                out.append(prompts.pop(0))
    return out


@dataclass(frozen=True)
class BuildRef:
    """An engine build in the store: its EngineConfig JSON content-addressed, and the build's manifest; a batch
    regime build's BatchConfig JSON content-addressed too, next to it."""

    name: str
    config_uri: str
    config_sha256: str
    manifest_uri: str
    batch_config_uri: str | None = None
    batch_config_sha256: str | None = None


def _config_json(config) -> bytes:
    return (json.dumps(config.to_dict(), indent=1, sort_keys=True) + "\n").encode()


def write_build(run: StageRun, candidate: Candidate) -> BuildRef:
    """Store the build's engine_config.json (and, batch regime, batch_config.json: the batched engine's
    mechanisms) as sha256 blobs and its manifest (config sha256s, candidate, code version, deployment fingerprint)
    under builds/<sha256 prefix of the build>/; also keep them in the stage's outputs."""
    dep, store = run.deployment, run.store
    (run.out_dir / "engine_config.json").write_bytes(_config_json(candidate.config))
    (run.out_dir / "build_candidate.json").write_text(json.dumps(candidate.to_dict(), indent=1))
    config = store_output(store, "engine_config.json", run.out_dir / "engine_config.json", key=None)
    described = store_output(store, "build_candidate.json", run.out_dir / "build_candidate.json", key=None)
    outputs, batch = [config, described], None
    if candidate.batch_config is not None:
        (run.out_dir / "batch_config.json").write_bytes(_config_json(candidate.batch_config))
        batch = store_output(store, "batch_config.json", run.out_dir / "batch_config.json", key=None)
        outputs.append(batch)
    # A build is both configs: the batched engine's mechanisms name it as much as the engine config does.
    build_id = config.sha256 if batch is None else digest_bytes(f"{config.sha256}+{batch.sha256}".encode()).sha256
    manifest = Manifest.now("build", run.request.run_id, inputs=tuple(run.request.inputs.values()),
                            outputs=tuple(outputs),
                            meta={"deployment": dep.name, "fingerprint": dep.fingerprint_digest(),
                                  "code_version": engine_code_version(), "candidate": candidate.to_dict(),
                                  "regime": dep.regime.label})
    uri = write_manifest(store, manifest, key=f"builds/{build_id[:16]}/{MANIFEST_NAME}")
    return BuildRef(candidate.name, config.uri, config.sha256, uri, batch.uri if batch else None,
                    batch.sha256 if batch else None)
