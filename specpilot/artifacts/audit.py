"""Audit a run: re-hash every artifact its manifests name and report what is missing or corrupted, by name.

Recorded checksums are never trusted: each output's stored bytes are streamed and hashed again. Inputs are
checked for existence when they live in the audited store (their contents are verified by the manifest
that produced them); inputs elsewhere (model hubs, other stores) are counted as external.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from specpilot.artifacts.manifest import MANIFEST_NAME, Manifest, read_manifest
from specpilot.artifacts.store import ArtifactNotFoundError, ArtifactStore, Digest, validate_prefix


class Problem(Enum):
    NO_MANIFESTS = "no manifests"
    BAD_MANIFEST = "unreadable manifest"
    MISSING = "missing"
    CORRUPTED = "corrupted"
    MISSING_INPUT = "missing input"
    OUTSIDE_STORE = "outside store"


@dataclass(frozen=True)
class AuditFailure:
    problem: Problem
    where: str  # the manifest's key (or the run prefix, for NO_MANIFESTS)
    artifact: str  # "<stage>/<output name>", the input URI, or "" when the whole manifest is bad
    uri: str
    detail: str


@dataclass(frozen=True)
class StageEntry:
    """One manifest of the run, in timeline order."""
    key: str
    manifest: Manifest


@dataclass(frozen=True)
class AuditReport:
    store_uri: str
    run_prefix: str
    stages: tuple[StageEntry, ...]
    failures: tuple[AuditFailure, ...]
    outputs_verified: int  # distinct output URIs re-hashed and matching
    inputs_checked: int
    inputs_external: int

    @property
    def ok(self) -> bool:
        return not self.failures


def _check_output(store: ArtifactStore, label: str, key: str, recorded: Digest, uri: str,
                  seen: dict[str, Digest | None]) -> AuditFailure | None:
    if not store.owns(uri):
        return AuditFailure(Problem.OUTSIDE_STORE, key, label, uri,
                            f"not in the audited store {store.root_uri}; audit with that store")
    if uri not in seen:  # content-addressed blobs may be named by several manifests: hash once
        try:
            seen[uri] = store.digest(uri)
        except ArtifactNotFoundError:
            seen[uri] = None
    actual = seen[uri]
    if actual is None:
        return AuditFailure(Problem.MISSING, key, label, uri,
                            f"expected sha256 {recorded.sha256[:16]}..., {recorded.bytes} bytes")
    if actual != recorded:
        return AuditFailure(Problem.CORRUPTED, key, label, uri,
                            f"sha256 {actual.sha256[:16]}... ({actual.bytes} bytes) != recorded "
                            f"{recorded.sha256[:16]}... ({recorded.bytes} bytes)")
    return None


def audit_run(store: ArtifactStore, run_prefix: str) -> AuditReport:
    """Check every manifest under `run_prefix` (e.g. runs/<run_id>) and every artifact it names."""
    if not run_prefix.strip("/"):
        raise ValueError("audit needs a run prefix such as runs/<run_id>, not the whole store")
    prefix = validate_prefix(run_prefix.rstrip("/") + "/")
    manifest_keys = [k for k in store.list(prefix) if k.rpartition("/")[2] == MANIFEST_NAME]
    failures: list[AuditFailure] = []
    stages: list[StageEntry] = []
    if not manifest_keys:
        failures.append(AuditFailure(Problem.NO_MANIFESTS, prefix, "", store.uri_for(prefix.rstrip("/")),
                                     f"no {MANIFEST_NAME} under {prefix} in {store.root_uri}"))
    for key in manifest_keys:
        try:
            stages.append(StageEntry(key, read_manifest(store, key)))
        except (ValueError, ArtifactNotFoundError) as e:
            failures.append(AuditFailure(Problem.BAD_MANIFEST, key, "", store.uri_for(key), str(e)))
    stages.sort(key=lambda s: (s.manifest.created, s.key))

    seen: dict[str, Digest | None] = {}
    matched: set[str] = set()
    mismatched: set[str] = set()
    inputs_checked = inputs_external = 0
    for entry in stages:
        m = entry.manifest
        for out in m.outputs:
            failure = _check_output(store, f"{m.stage}/{out.name}", entry.key, out.digest, out.uri, seen)
            if failure is None:
                matched.add(out.uri)
            else:
                failures.append(failure)
                mismatched.add(out.uri)
        for uri in m.inputs:
            if not store.owns(uri):
                inputs_external += 1
                continue
            inputs_checked += 1
            if not store.exists(uri):
                failures.append(AuditFailure(Problem.MISSING_INPUT, entry.key, f"{m.stage} input", uri,
                                             "input named by the manifest does not exist"))
    return AuditReport(store.root_uri, prefix.rstrip("/"), tuple(stages), tuple(failures),
                       len(matched - mismatched), inputs_checked, inputs_external)


def _ran(timing: object) -> str:
    """"  [ran 12.3s on cuda:1]" from a stage manifest's timing record (stages/io.StageTiming), if it has one."""
    if not isinstance(timing, dict) or not {"started", "finished", "device"} <= set(timing):
        return ""
    try:
        seconds = (datetime.fromisoformat(timing["finished"]) - datetime.fromisoformat(timing["started"])).total_seconds()
    except (TypeError, ValueError):
        return ""
    return f"  [ran {seconds:.1f}s on {timing['device']}]"


def format_audit(report: AuditReport) -> str:
    """The stage timeline (from manifest timestamps) followed by every failure, one line each."""
    lines = [f"audit of {report.run_prefix} in {report.store_uri}"]
    if report.stages:
        start = report.stages[0].manifest.created
        lines.append("timeline:")
        width = max(len(s.manifest.stage) for s in report.stages)
        for s in report.stages:
            m = s.manifest
            offset = (m.created - start).total_seconds()
            ran = _ran(m.meta.get("timing"))
            lines.append(f"  {m.created.isoformat(timespec='seconds')}  +{offset:9.1f}s  {m.stage:<{width}}  "
                         f"{len(m.outputs):3d} outputs  {len(m.inputs):3d} inputs  {s.key}{ran}")
    lines.append(f"{report.outputs_verified} outputs re-hashed and matching, {report.inputs_checked} inputs present"
                 f", {report.inputs_external} external inputs not checked")
    if report.ok:
        lines.append("OK")
        return "\n".join(lines)
    lines.append(f"FAILED: {len(report.failures)} problem(s)")
    for f in report.failures:
        name = f.artifact or f.where
        lines.append(f"  {f.problem.value:<19} {name}  {f.uri}  ({f.detail})")
    return "\n".join(lines)
