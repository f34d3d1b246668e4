"""Stage manifests: what a stage read, what it wrote (with sha256 sums), when, and free-form metadata.

Layout convention in a store: `runs/<run_id>/<stage>[/<qualifier>...]/manifest.json`, so that everything
one run produced sits under `runs/<run_id>/` and `audit_run` can find every manifest by listing that prefix.
Outputs themselves may live anywhere in the store (content-addressed blobs are shared between runs).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specpilot.artifacts.store import (
    ArtifactStore, Digest, blob_key, digest_bytes, digest_file, validate_key,
)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{kind} must be letters, digits, '_', '.', '-' (no '/'), got {value!r}")


def new_run_id(now: datetime | None = None) -> str:
    """Sortable and unique: UTC timestamp plus random hex, e.g. 20260101T120000Z-3f9a1c."""
    now = now or datetime.now(timezone.utc)
    return f"{now.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def run_started(run_id: str) -> datetime | None:
    """When a run made by new_run_id started (its id begins with the UTC timestamp); None for other ids."""
    try:
        return datetime.strptime(run_id.split("-", 1)[0], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def run_prefix(run_id: str) -> str:
    _check_name("run id", run_id)
    return f"runs/{run_id}"


def stage_prefix(run_id: str, stage: str, *qualifiers: str) -> str:
    """runs/<run_id>/<stage>[/<qualifier>...], e.g. stage_prefix(r, "explore", "round1", "gpu0")."""
    for part in (stage, *qualifiers):
        _check_name("stage path part", part)
    return "/".join((run_prefix(run_id), stage, *qualifiers))


@dataclass(frozen=True)
class ArtifactEntry:
    """One output: a stage-local name, where it is stored, and the sha256/size it had when written."""
    name: str
    uri: str
    sha256: str
    bytes: int

    def __post_init__(self) -> None:
        _check_name("artifact name", self.name)
        if not isinstance(self.uri, str) or "://" not in self.uri:
            raise ValueError(f"artifact {self.name!r}: uri must be a URI, got {self.uri!r}")
        Digest(self.sha256, self.bytes)  # validates hex and size

    @property
    def digest(self) -> Digest:
        return Digest(self.sha256, self.bytes)


@dataclass(frozen=True)
class Manifest:
    stage: str
    run_id: str
    created: datetime
    inputs: tuple[str, ...] = ()
    outputs: tuple[ArtifactEntry, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_name("stage", self.stage)
        _check_name("run id", self.run_id)
        if not isinstance(self.created, datetime) or self.created.tzinfo is None:
            raise ValueError(f"manifest created time must be timezone-aware, got {self.created!r}")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        for uri in self.inputs:  # URIs, not paths, so an audit can tell the store's artifacts from external ones
            if not isinstance(uri, str) or "://" not in uri:
                raise ValueError(f"manifest inputs must be URIs (scheme://...; Path.as_uri() for local files), "
                                 f"got {uri!r}")
        names = [o.name for o in self.outputs]
        if len(names) != len(set(names)):
            raise ValueError(f"duplicate output names in {self.stage} manifest: {sorted(names)}")
        try:  # a deep copy that also proves meta survives the JSON round trip
            object.__setattr__(self, "meta", json.loads(json.dumps(dict(self.meta), allow_nan=False)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"manifest meta must be JSON-serialisable: {e}") from None

    @classmethod
    def now(cls, stage: str, run_id: str, **kwargs: Any) -> "Manifest":
        return cls(stage=stage, run_id=run_id, created=datetime.now(timezone.utc), **kwargs)

    def output(self, name: str) -> ArtifactEntry:
        for entry in self.outputs:
            if entry.name == name:
                return entry
        raise KeyError(f"{self.stage} manifest of run {self.run_id} has no output {name!r}; "
                       f"outputs: {[o.name for o in self.outputs]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "stage": self.stage,
            "run_id": self.run_id,
            "created": self.created.isoformat(),
            "inputs": list(self.inputs),
            "outputs": [{"name": o.name, "uri": o.uri, "sha256": o.sha256, "bytes": o.bytes} for o in self.outputs],
            "meta": self.meta,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unsupported manifest format {data.get('format')!r} (this code reads {MANIFEST_FORMAT})")
        try:
            return cls(
                stage=data["stage"], run_id=data["run_id"], created=datetime.fromisoformat(data["created"]),
                inputs=tuple(data.get("inputs", ())),
                outputs=tuple(ArtifactEntry(**o) for o in data.get("outputs", ())),
                meta=data.get("meta", {}),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed manifest: {e!r}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("manifest JSON must be an object")
        return cls.from_dict(data)

    def save(self, path: Path) -> Path:
        """Write to a local file (the `--in M.json` a bare-host stage reads)."""
        Path(path).write_text(self.to_json())
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> "Manifest":
        try:
            return cls.from_json(Path(path).read_bytes())
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def store_output(store: ArtifactStore, name: str, local_path: Path, key: str | None = None) -> ArtifactEntry:
    """Upload a stage output and describe it; without `key` it is stored content-addressed (deduplicated)."""
    digest = digest_file(Path(local_path))
    uri = store.put_blob(Path(local_path)) if key is None else store.put_file(Path(local_path), key)
    return ArtifactEntry(name=name, uri=uri, sha256=digest.sha256, bytes=digest.bytes)


def store_output_bytes(store: ArtifactStore, name: str, data: bytes, key: str | None = None) -> ArtifactEntry:
    digest = digest_bytes(data)
    uri = store.put_blob_bytes(data) if key is None else store.put_bytes(data, key)
    return ArtifactEntry(name=name, uri=uri, sha256=digest.sha256, bytes=digest.bytes)


def default_manifest_key(manifest: Manifest) -> str:
    return f"{stage_prefix(manifest.run_id, manifest.stage)}/{MANIFEST_NAME}"


def write_manifest(store: ArtifactStore, manifest: Manifest, key: str | None = None) -> str:
    """Store the manifest (default key runs/<run>/<stage>/manifest.json) and return its URI."""
    key = default_manifest_key(manifest) if key is None else validate_key(key)
    if key.rpartition("/")[2] != MANIFEST_NAME:
        raise ValueError(f"manifest key must end in /{MANIFEST_NAME} so audits find it, got {key!r}")
    if key.startswith(blob_key("")):
        raise ValueError(f"manifests are not content-addressed blobs: {key!r}")
    return store.put_bytes(manifest.to_json().encode(), key)


def read_manifest(store: ArtifactStore, ref: str) -> Manifest:
    """Read a manifest by URI or key; ArtifactNotFoundError if absent, ValueError naming the URI if malformed."""
    data = store.get_bytes(ref)
    try:
        return Manifest.from_json(data)
    except ValueError as e:
        raise ValueError(f"{store.uri_for(store.key_for(ref))}: {e}") from None
