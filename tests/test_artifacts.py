"""Artifact stores (local directory and a real SeaweedFS S3 server), content addressing, manifests, audits."""
from __future__ import annotations

import hashlib
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from specpilot.artifacts import (
    ArtifactEntry, ArtifactNotFoundError, ArtifactStore, LocalStore, Manifest, Problem, S3Config, S3Store, StoreError,
    StoreUnreachableError, audit_run, blob_key, format_audit, read_manifest, run_prefix, store_from_uri, store_output,
    store_output_bytes, write_manifest,
)
from specpilot.artifacts.cli import main as artifacts_cli

pytest_plugins = ["conftest_s3"]

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path) -> ArtifactStore:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_credentials")
    # A fresh prefix per test keeps tests independent while sharing one bucket and server.
    return S3Store(S3Config(bucket=server.bucket, prefix=f"t-{uuid.uuid4().hex[:8]}",
                            endpoint_url=server.endpoint_url, max_attempts=2))


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_put_get_list_delete(store: ArtifactStore, tmp_path: Path):
    uri = store.put_file(_file(tmp_path / "a.bin", b"alpha"), "runs/r1/profile/a.bin")
    assert store.key_for(uri) == "runs/r1/profile/a.bin" and store.uri_for("runs/r1/profile/a.bin") == uri
    assert store.put_bytes(b"beta", "runs/r12/x.txt") == store.uri_for("runs/r12/x.txt")
    assert store.get_bytes(uri) == b"alpha" and store.get_bytes("runs/r12/x.txt") == b"beta"
    assert store.get_file(uri, tmp_path / "out" / "copy.bin").read_bytes() == b"alpha"
    assert store.digest(uri).sha256 == hashlib.sha256(b"alpha").hexdigest() and store.digest(uri).bytes == 5
    assert store.list("runs/r1") == ["runs/r1/profile/a.bin", "runs/r12/x.txt"]  # string prefix, as in S3
    assert store.list("runs/r1/") == ["runs/r1/profile/a.bin"]
    assert store.list("nothing/") == []
    store.put_bytes(b"alpha2", "runs/r1/profile/a.bin")  # replacing is allowed
    assert store.get_bytes(uri) == b"alpha2"
    store.delete(uri)
    store.delete(uri)  # idempotent, as in S3
    assert not store.exists(uri) and store.exists("runs/r12/x.txt")
    with pytest.raises(ArtifactNotFoundError, match="artifact not found: " + uri):
        store.get_bytes(uri)
    with pytest.raises(FileNotFoundError, match=uri):  # the CLI reports FileNotFoundError as one clear line
        store.get_file(uri, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_keys_and_foreign_uris_are_rejected(store: ArtifactStore):
    for bad in ("/abs/key", "a//b", "../up", "a/./b", "", "back\\slash"):
        with pytest.raises(ValueError):
            store.put_bytes(b"x", bad)
    with pytest.raises(ValueError, match="is not"):
        store.key_for("s3://some-other-bucket/k")
    assert not store.owns("file:///elsewhere/k") and store.owns(store.uri_for("a/b"))


def test_blobs_are_content_addressed_and_stored_once(store: ArtifactStore, tmp_path: Path):
    data = b"packed weights" * 1000
    first = store.put_blob(_file(tmp_path / "w1.bin", data))
    second = store.put_blob(_file(tmp_path / "w2.bin", data))
    assert first == second == store.uri_for(blob_key(hashlib.sha256(data).hexdigest()))
    assert store.list("blobs/") == [store.key_for(first)]
    # A blob already present is not uploaded again: overwrite it, and putting the same content leaves it alone.
    store.put_bytes(b"sentinel", store.key_for(first))
    assert store.put_blob(tmp_path / "w1.bin") == first and store.get_bytes(first) == b"sentinel"
    other = store.put_blob_bytes(b"different")
    assert other != first and store.get_bytes(other) == b"different"
    assert len(store.list("blobs/sha256/")) == 2


def test_manifest_round_trip_and_validation(store: ArtifactStore, tmp_path: Path):
    steps = store_output(store, "steps", _file(tmp_path / "steps.parquet", b"PAR1"),
                         key="runs/r1/profile/steps.parquet")
    summary = store_output_bytes(store, "summary", b'{"tok_s": 1}')  # content-addressed
    m = Manifest(stage="profile", run_id="r1", created=T0, inputs=["hf://HuggingFaceTB/SmolLM2-135M"],
                 outputs=[steps, summary], meta={"gpu": "H200", "rounds": [1, 2]})
    assert Manifest.from_json(m.to_json()) == m
    assert Manifest.load(m.save(tmp_path / "m.json")) == m
    uri = write_manifest(store, m)
    assert store.key_for(uri) == "runs/r1/profile/manifest.json" and read_manifest(store, uri) == m
    assert m.output("summary").uri.endswith(summary.sha256) and m.output("steps").bytes == 4
    with pytest.raises(KeyError, match="no output 'trace'"):
        m.output("trace")
    with pytest.raises(ValueError, match="timezone-aware"):
        Manifest(stage="profile", run_id="r1", created=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="duplicate output names"):
        Manifest(stage="profile", run_id="r1", created=T0, outputs=[steps, steps])
    with pytest.raises(ValueError, match="JSON-serialisable"):
        Manifest(stage="profile", run_id="r1", created=T0, meta={"x": object()})
    with pytest.raises(ValueError, match="sha256"):
        ArtifactEntry(name="x", uri="file:///x", sha256="abc", bytes=1)
    with pytest.raises(ValueError, match="inputs must be URIs"):
        Manifest(stage="profile", run_id="r1", created=T0, inputs=["/local/path/model"])
    with pytest.raises(ValueError, match="end in /manifest.json"):
        write_manifest(store, m, key="runs/r1/profile/m.json")
    store.put_bytes(b"{not json", "runs/r1/broken/manifest.json")
    with pytest.raises(ValueError, match="runs/r1/broken/manifest.json.*not valid JSON"):
        read_manifest(store, "runs/r1/broken/manifest.json")


def _two_stage_run(store: ArtifactStore, tmp_path: Path, run_id: str) -> None:
    steps = store_output(store, "steps", _file(tmp_path / "steps.parquet", b"steps" * 100),
                         key=f"{run_prefix(run_id)}/profile/steps.parquet")
    summary = store_output_bytes(store, "summary", b"summary")
    profile_uri = write_manifest(store, Manifest(stage="profile", run_id=run_id, created=T0, outputs=[steps, summary]))
    attribution = store_output_bytes(store, "attribution", b'{"direction": "tau"}',
                                     key=f"{run_prefix(run_id)}/attribute/attribution.json")
    write_manifest(store, Manifest(stage="attribute", run_id=run_id, created=T0 + timedelta(seconds=42),
                                   inputs=[profile_uri, steps.uri, "hf://external/model"], outputs=[attribution]))


def test_audit_detects_deleted_and_corrupted_artifacts(store: ArtifactStore, tmp_path: Path):
    _two_stage_run(store, tmp_path, "r1")
    clean = audit_run(store, "runs/r1")
    assert clean.ok and clean.outputs_verified == 3 and clean.inputs_checked == 2 and clean.inputs_external == 1
    assert [s.manifest.stage for s in clean.stages] == ["profile", "attribute"]
    text = format_audit(clean)
    assert text.index("profile") < text.index("attribute") and "+     42.0s" in text and text.endswith("OK")

    store.delete("runs/r1/profile/steps.parquet")
    store.put_bytes(b'{"direction": "TAU"}', "runs/r1/attribute/attribution.json")  # same size, other bytes
    report = audit_run(store, "runs/r1")
    problems = {(f.problem, f.artifact) for f in report.failures}
    assert problems == {(Problem.MISSING, "profile/steps"), (Problem.CORRUPTED, "attribute/attribution"),
                        (Problem.MISSING_INPUT, "attribute input")}
    assert report.outputs_verified == 1  # only the summary blob still matches
    text = format_audit(report)
    assert "FAILED: 3 problem(s)" in text
    assert "missing             profile/steps  " + store.uri_for("runs/r1/profile/steps.parquet") in text
    assert "corrupted           attribute/attribution" in text


def test_audit_of_an_unknown_run_fails(store: ArtifactStore):
    report = audit_run(store, "runs/nope")
    assert not report.ok and [f.problem for f in report.failures] == [Problem.NO_MANIFESTS]
    assert "no manifest.json under runs/nope/" in format_audit(report)


def test_audit_cli_exit_codes(tmp_path: Path, capsys):
    store = LocalStore(tmp_path / "store")
    _two_stage_run(store, tmp_path, "20260102T030405Z-abc123")
    assert artifacts_cli(["audit", "20260102T030405Z-abc123", "--store", str(store.root)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")
    (store.root / "runs/20260102T030405Z-abc123/profile/steps.parquet").write_bytes(b"tampered")
    assert artifacts_cli(["audit", "20260102T030405Z-abc123", "--store", store.root_uri]) == 1
    out = capsys.readouterr().out
    assert "corrupted" in out and "profile/steps" in out
    assert artifacts_cli(["audit", "r1", "--store", "ftp://host/x"]) == 2
    assert "unsupported artifact store URI" in capsys.readouterr().err


def test_store_from_uri_picks_the_implementation(tmp_path: Path):
    assert isinstance(store_from_uri(tmp_path / "a"), LocalStore)
    local = store_from_uri(str(tmp_path / "a"))
    assert isinstance(local, LocalStore) and local.root == (tmp_path / "a").resolve()
    assert store_from_uri(local.root_uri).root == local.root
    s3 = store_from_uri("s3://my-bucket/team/specpilot?endpoint=http://127.0.0.1:9000&region=eu-west-1&max_attempts=3")
    assert isinstance(s3, S3Store)
    assert s3.config == S3Config(bucket="my-bucket", prefix="team/specpilot", endpoint_url="http://127.0.0.1:9000",
                                 region="eu-west-1", max_attempts=3)
    assert s3.uri_for("runs/r/x") == "s3://my-bucket/team/specpilot/runs/r/x"
    assert store_from_uri(s3.root_uri).config == S3Config(bucket="my-bucket", prefix="team/specpilot",
                                                          endpoint_url="http://127.0.0.1:9000", region="eu-west-1")
    with pytest.raises(ValueError, match="unsupported artifact store URI"):
        store_from_uri("gs://bucket/x")
    with pytest.raises(ValueError, match="unknown S3 store URI parameter"):
        store_from_uri("s3://my-bucket?endpoint_url=http://x")
    with pytest.raises(ValueError, match="invalid S3 bucket name"):
        S3Config(bucket="No_Such")


def test_unreachable_s3_endpoint_fails_fast_naming_endpoint_and_bucket(s3_credentials, unreachable_endpoint,
                                                                       tmp_path: Path):
    endpoint = unreachable_endpoint
    store = S3Store(S3Config(bucket="some-bucket", endpoint_url=endpoint, connect_timeout_s=0.5, max_attempts=1))
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=f"cannot reach S3 endpoint {endpoint}, bucket some-bucket"):
        store.put_bytes(b"x", "runs/r/x")
    with pytest.raises(StoreUnreachableError):
        store.exists("runs/r/x")  # unreachable is an error, never "does not exist"
    with pytest.raises(StoreUnreachableError, match="bucket some-bucket"):
        store.put_file(_file(tmp_path / "f", b"f"), "runs/r/f")  # the multipart-capable upload path
    with pytest.raises(StoreUnreachableError, match="bucket some-bucket"):
        store.get_file("runs/r/f", tmp_path / "g")
    with pytest.raises(StoreUnreachableError, match="bucket some-bucket"):
        store.list("runs/")
    assert time.monotonic() - started < 5


@pytest.mark.s3
def test_s3_missing_bucket_is_named(s3_server, s3_credentials):
    store = S3Store(S3Config(bucket="no-such-bucket-here", endpoint_url=s3_server.endpoint_url, max_attempts=1))
    # SeaweedFS answers AccessDenied rather than NoSuchBucket here; either way the error says where.
    with pytest.raises(StoreError, match=f"S3 endpoint {s3_server.endpoint_url}, bucket no-such-bucket-here"):
        store.put_bytes(b"x", "k")
    store.create_bucket()
    store.put_bytes(b"x", "k")
    assert store.get_bytes("k") == b"x"
