"""A whole tune flow against a real S3 server (SeaweedFS `weed server -s3`): every artifact of the run lands in
the bucket, the run audits clean, and after one object is deleted and another corrupted `specpilot audit RUN`
(the installed command, in a subprocess) exits 1 naming both artifacts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from specpilot.artifacts import MANIFEST_NAME, Manifest, store_from_uri
from specpilot.memory import Memory

pytest_plugins = ["conftest_s3"]
pytestmark = [pytest.mark.s3, pytest.mark.prefect]

# The smallest tune that still runs every stage: two trials, short generations.
OVERRIDES = {"explore": {"max_new_tokens": 16, "trials": 2, "batch": 2}}
STAGES = {"recall", "profile", "attribute", "explore", "validate", "integrate"}


def _credentials() -> dict[str, str]:
    # Imported here, not at the top: pytest registers conftest_s3 as a plugin first (assertion rewriting).
    from conftest_s3 import DUMMY_CREDENTIALS
    return dict(DUMMY_CREDENTIALS)


def _client(server):
    creds = _credentials()
    return boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"], aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
                        config=Config(s3={"addressing_style": "path"}))


def _keys(client, bucket: str, prefix: str) -> set[str]:
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys |= {o["Key"] for o in page.get("Contents", [])}
    return keys


@pytest.fixture(scope="module")
def s3_run(prefect_harness, s3_server, tiny_deployment, tmp_path_factory):
    """One tune of tiny-a with its artifacts in a fresh prefix of the SeaweedFS bucket."""
    from specpilot.flows.report import TuneReport
    from specpilot.flows.tune import tune

    root = tmp_path_factory.mktemp("s3-tune")
    prefix = f"tune-{uuid.uuid4().hex[:8]}"
    store_uri = f"s3://{s3_server.bucket}/{prefix}?endpoint={s3_server.endpoint_url}"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in _credentials().items():
            patch.setenv(name, value)
        # Anything that fell back to the default store would land here, and the test would see it.
        patch.setenv("SPECPILOT_STORE", str(root / "default-store"))
        report = TuneReport.from_dict(tune(str(tiny_deployment), rounds=1, gpus=1, store=store_uri,
                                           memory=str(root / "memory.duckdb"), work_dir=str(root / "work"),
                                           overrides=OVERRIDES))
        yield {"report": report, "store_uri": store_uri, "prefix": prefix, "root": root, "server": s3_server}


def _audit(s3_run) -> subprocess.CompletedProcess:
    """`specpilot audit RUN --store s3://...` through the installed console script, credentials in its env."""
    specpilot = Path(sys.executable).with_name("specpilot")
    assert specpilot.exists(), f"console script {specpilot} missing: pip install -e . first"
    env = {**os.environ, **_credentials()}
    return subprocess.run([str(specpilot), "audit", s3_run["report"].run_id, "--store", s3_run["store_uri"]],
                          capture_output=True, text=True, env=env, timeout=120)


def test_every_artifact_of_the_run_is_in_the_bucket(s3_run):
    report, server, prefix = s3_run["report"], s3_run["server"], s3_run["prefix"]
    client = _client(server)
    run_keys = _keys(client, server.bucket, f"{prefix}/runs/{report.run_id}/")
    work = s3_run["root"] / "work"
    # Every file a stage wrote to its output directory; <dir>.scratch holds working files that are not outputs.
    local = sorted(p for p in work.rglob("*") if p.is_file()
                   and not any(part.endswith(".scratch") for part in p.relative_to(work).parts))
    assert local, "the flow wrote no stage outputs"
    stages_seen = set()
    for path in local:  # outputs, request.json and manifest.json: each has its object, same bytes
        rel = path.relative_to(work).as_posix()
        stages_seen.add(rel.split("/")[0])
        key = f"{prefix}/runs/{report.run_id}/{rel}"
        assert key in run_keys, f"{rel} was not uploaded to s3://{server.bucket}/{key}"
        stored = client.get_object(Bucket=server.bucket, Key=key)["Body"].read()
        if path.name == MANIFEST_NAME:
            assert Manifest.from_json(stored) == Manifest.load(path)
        else:
            assert stored == path.read_bytes(), f"{key} differs from the stage's local output"
    assert stages_seen == STAGES
    # ... and every object a manifest names is in this bucket and prefix: the final build, evidence URIs too.
    store = store_from_uri(s3_run["store_uri"])
    assert report.build_uri.startswith(f"s3://{server.bucket}/{prefix}/builds/") and store.exists(report.build_uri)
    for key in (k for k in run_keys if k.endswith("/" + MANIFEST_NAME)):
        manifest = Manifest.from_json(client.get_object(Bucket=server.bucket, Key=key)["Body"].read())
        for out in manifest.outputs:
            assert out.uri.startswith(f"s3://{server.bucket}/{prefix}/") and store.exists(out.uri), out.uri
    with Memory.open(s3_run["root"] / "memory.duckdb", read_only=True) as memory:
        uris = [u for (row,) in memory.sql("SELECT artifact_uris FROM evidence").rows for u in json.loads(row)]
        failures = memory.sql("SELECT count(*) FROM failures WHERE run_id = ?", params=[report.run_id]).rows[0][0]
    assert all(u.startswith(f"s3://{server.bucket}/{prefix}/") and store.exists(u) for u in uris)
    # Evidence exists when a candidate beat stock on this machine's timing; when none did (a noisy 2-core run: the
    # CI of stop 19 saw it), the run recorded the validated candidates as failures instead. One or the other.
    assert uris or failures
    assert not (s3_run["root"] / "default-store").exists(), "something wrote to the default local store"


def test_audit_fails_naming_the_deleted_and_the_corrupted_artifact(s3_run):
    report, server, prefix = s3_run["report"], s3_run["server"], s3_run["prefix"]
    clean = _audit(s3_run)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.rstrip().endswith("OK") and "[ran " in clean.stdout  # stage timeline with timings

    client = _client(server)
    run = f"{prefix}/runs/{report.run_id}"
    steps = f"{run}/profile/round0/steps.parquet"
    attribution = f"{run}/attribute/round1/attribution.json"
    client.delete_object(Bucket=server.bucket, Key=steps)
    original = client.get_object(Bucket=server.bucket, Key=attribution)["Body"].read()
    client.put_object(Bucket=server.bucket, Key=attribution, Body=original.replace(b"{", b"[", 1))  # same size

    broken = _audit(s3_run)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    lines = broken.stdout.splitlines()
    assert "FAILED: 2 problem(s)" in lines
    missing = [line for line in lines if line.strip().startswith("missing")]
    corrupted = [line for line in lines if line.strip().startswith("corrupted")]
    assert len(missing) == 1 and "profile/steps.parquet" in missing[0]
    assert f"s3://{server.bucket}/{steps}" in missing[0]
    assert len(corrupted) == 1 and "attribute/attribution.json" in corrupted[0]
    assert f"s3://{server.bucket}/{attribution}" in corrupted[0]
