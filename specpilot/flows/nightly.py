"""The `nightly` flow: re-tune every deployment whose fingerprint (model and drafter weights, GPU, workload,
engine config and engine code) changed since its last successful run in memory; skip the unchanged ones."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, get_run_logger  # noqa: E402

from specpilot.deployments import DeviceKind, ModelRefKind, list_deployments, load_deployment  # noqa: E402
from specpilot.flows.tune import tune  # noqa: E402
from specpilot.memory import Memory, default_memory_path  # noqa: E402


@dataclass(frozen=True)
class NightlyDecision:
    deployment: str  # as given (name or YAML path)
    name: str  # the deployment's name, as memory records it
    fingerprint: str
    last_fingerprint: str | None  # of its last successful run, None if never tuned
    retune: bool
    reason: str


def last_fingerprint(memory_path: str | Path | None, deployment_name: str) -> str | None:
    """Fingerprint digest of the deployment's most recent successful run (read-only; None when none)."""
    path = Path(memory_path).expanduser() if memory_path else default_memory_path()
    if not path.exists():
        return None
    with Memory.open(path, read_only=True) as memory:
        rows = memory.sql("SELECT fingerprint FROM runs WHERE deployment = ? AND status = 'succeeded' "
                          "ORDER BY started DESC LIMIT 1", params=[deployment_name]).rows
    if not rows:
        return None
    recorded = rows[0][0]
    return (json.loads(recorded) if isinstance(recorded, str) else recorded).get("digest")


def plan_nightly(deployments: list[str], memory_path: str | Path | None) -> list[NightlyDecision]:
    decisions = []
    for ref in deployments:
        dep = load_deployment(ref)
        now, last = dep.fingerprint_digest(), last_fingerprint(memory_path, dep.name)
        if last is None:
            reason = "never tuned"
        elif last != now:
            reason = f"fingerprint changed ({last} -> {now}): model, drafter, device, workload or engine code"
        else:
            reason = f"unchanged since its last successful run ({now})"
        decisions.append(NightlyDecision(ref, dep.name, now, last, last != now, reason))
    return decisions


def runnable_here() -> list[str]:
    """Shipped deployments this host can run (CUDA ones only with a GPU) whose targets are real models: a
    random-weight target measures kernels, not acceptance, so there is nothing to tune for speed on it."""
    import torch

    kinds = {DeviceKind.CPU} | ({DeviceKind.CUDA} if torch.cuda.is_available() else set())
    return [name for name in list_deployments()
            if (dep := load_deployment(name)).device.kind in kinds and dep.target.kind is not ModelRefKind.RANDOM]


@flow(name="nightly")
def nightly(deployments: list[str] | None = None, rounds: int = 1, gpus: int = 1, store: str | None = None,
            memory: str | None = None, trials: int | None = None) -> list[dict[str, Any]]:
    """Re-tune changed deployments (default: every shipped deployment this host can run)."""
    logger = get_run_logger()
    out = []
    for decision in plan_nightly(deployments or runnable_here(), memory):
        logger.info("%s: %s", decision.name, decision.reason + ("; re-tuning" if decision.retune else "; skipped"))
        report = None
        if decision.retune:
            gpu_count = gpus if load_deployment(decision.deployment).device.kind is DeviceKind.CUDA else 1
            report = tune(decision.deployment, rounds=rounds, gpus=gpu_count, store=store, memory=memory, trials=trials)
        out.append({**asdict(decision), "report": report})
    return out
