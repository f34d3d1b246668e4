"""prefect.yaml against a real Prefect server: `prefect server start` in a subprocess, `prefect deploy` of the
on-demand and nightly deployments, a flow run of `tune/tune` created through the REST API, and a process
worker (`prefect worker start --run-once`) that runs it to COMPLETED on the tiny deployment.

Every Prefect command runs as the user would run it (the venv's `prefect`, PREFECT_API_URL pointing at the
server, a throwaway PREFECT_HOME), from the repository root where prefect.yaml lives.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from specpilot.artifacts import audit_run, store_from_uri

pytestmark = pytest.mark.prefect
REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "specpilot-process"  # prefect.yaml's process work pool
OVERRIDES = {"explore": {"max_new_tokens": 16, "trials": 2, "batch": 2}}
_STARTUP_S = 90.0


@dataclass(frozen=True)
class PrefectServer:
    api_url: str
    env: dict[str, str]  # what every Prefect command of the test runs with
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefect(server: PrefectServer, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PREFECT, *args], cwd=REPO, env=server.env, capture_output=True, text=True, timeout=timeout)


# Prefect's server answers 503 while its SQLite database is locked (its scheduler services write beside the test's
# calls); Prefect's own client retries those, so the test's REST calls do too.
_RETRY_CODES, _RETRIES = (429, 502, 503), 8


def _api(method: str, url: str, **kwargs) -> httpx.Response:
    for attempt in range(_RETRIES - 1):
        r = httpx.request(method, url, timeout=10, **kwargs)
        if r.status_code not in _RETRY_CODES:
            return r
        time.sleep(float(r.headers.get("Retry-After", 0.5 * 2 ** attempt)))
    return httpx.request(method, url, timeout=10, **kwargs)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[PrefectServer]:
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "SPECPILOT_REPO": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PREFECT_PROFILES_PATH", None)
    log = home / "server.log"
    with open(log, "wb") as out:
        # Its own process group: the server's children (services, uvicorn) are stopped with it.
        proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + _STARTUP_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server not healthy after {_STARTUP_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield PrefectServer(api, env, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def deployed(prefect_server) -> dict[str, str]:
    """The process work pool and both deployments of prefect.yaml; returns deployment ids by name."""
    pool = _prefect(prefect_server, "work-pool", "create", POOL, "--type", "process")
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deploy = _prefect(prefect_server, "--no-prompt", "deploy", "--name", "tune", "--name", "nightly")
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    ids = {}
    for flow, name in (("tune", "tune"), ("nightly", "nightly")):
        r = _api("GET", f"{prefect_server.api_url}/deployments/name/{flow}/{name}")
        assert r.status_code == 200, f"deployment {flow}/{name} not on the server: {r.text}"
        ids[name] = r.json()["id"]
    # The nightly schedule stays registered but paused: the worker below must only see the run this test makes.
    _api("PATCH", f"{prefect_server.api_url}/deployments/{ids['nightly']}", json={"paused": True}).raise_for_status()
    return ids


def test_deploy_registers_both_deployments_with_prefect_yaml_settings(prefect_server, deployed):
    api = prefect_server.api_url
    tune = _api("GET", f"{api}/deployments/{deployed['tune']}").json()
    assert (tune["entrypoint"], tune["work_pool_name"]) == ("specpilot/flows/tune.py:tune", POOL)
    assert tune["parameters"] == {"deployment": "smollm2-135m-cpu", "rounds": 1, "gpus": 1}
    assert {"deployment", "rounds", "gpus", "store", "memory", "overrides"} <= set(
        tune["parameter_openapi_schema"]["properties"])
    schedules = _api("GET", f"{api}/deployments/{deployed['nightly']}/schedules").json()
    assert [s["schedule"]["cron"] for s in schedules] == ["0 2 * * *"]


def test_process_worker_runs_the_on_demand_deployment(prefect_server, deployed, tiny_deployment, tmp_path):
    api = prefect_server.api_url
    store = tmp_path / "store"
    parameters = {"deployment": str(tiny_deployment), "rounds": 1, "gpus": 1, "store": str(store),
                  "memory": str(tmp_path / "memory.duckdb"), "work_dir": str(tmp_path / "work"), "overrides": OVERRIDES}
    created = _api("POST", f"{api}/deployments/{deployed['tune']}/create_flow_run", json={"parameters": parameters})
    created.raise_for_status()
    run_id = created.json()["id"]

    worker = _prefect(prefect_server, "worker", "start", "--pool", POOL, "--run-once", timeout=300)
    state = _api("GET", f"{api}/flow_runs/{run_id}").json()["state"]
    assert state["type"] == "COMPLETED", (f"flow run ended {state['type']}: {state.get('message')}\n"
                                          f"{worker.stdout[-4000:]}\n{worker.stderr[-4000:]}")
    # The run did the real work: its artifacts audit clean, and the UI shows its Prefect artifacts.
    (run_dir,) = (store / "runs").iterdir()
    report = audit_run(store_from_uri(store), f"runs/{run_dir.name}")
    assert report.ok and {s.manifest.stage for s in report.stages} >= {"profile", "explore", "validate", "integrate"}
    artifacts = _api("POST", f"{api}/artifacts/filter",
                     json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}).json()
    keys = {a["key"] for a in artifacts}
    assert {"tiny-a-tune-summary", "tiny-a-explore-timeline-r1", "tiny-a-final-build"} <= keys
