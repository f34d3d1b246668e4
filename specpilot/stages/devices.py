"""Devices of stage runs: one DeploymentSession (models loaded once) per (deployment, device), the device made
current for a stage's thread, and one measurement per device at a time."""
from __future__ import annotations

import platform
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specpilot.bench.session import DeploymentSession
from specpilot.deployments import Deployment, DeviceKind, load_deployment

_SESSIONS: dict[tuple[str, str], DeploymentSession] = {}
_DEVICE_LOCKS: dict[str, threading.Lock] = {}
_REGISTRY_LOCK = threading.Lock()


def _deployment_key(ref: str) -> str:
    p = Path(ref).expanduser()
    return str(p.resolve()) if p.suffix in (".yaml", ".yml") else ref


def session_for(deployment: str, device: str) -> DeploymentSession:
    key = (_deployment_key(deployment), device)
    with _REGISTRY_LOCK:
        if key not in _SESSIONS:
            _SESSIONS[key] = DeploymentSession(load_deployment(deployment), device=device)
        return _SESSIONS[key]


@contextmanager
def on_device(device: str) -> Iterator[None]:
    """Make `device` current for this thread: the CUDA current device is per thread, and Triton launches and
    graph captures go to it, so a stage pinned to cuda:1 in a worker thread would otherwise launch on cuda:0."""
    if not device.startswith("cuda"):
        yield
        return
    import torch
    with torch.cuda.device(torch.device(device)):
        yield


@contextmanager
def exclusive(device: str) -> Iterator[None]:
    """Hold a device for a measurement: concurrent tasks on one device would time each other."""
    with _REGISTRY_LOCK:
        lock = _DEVICE_LOCKS.setdefault(device, threading.Lock())
    with lock:
        if device.startswith("cuda"):
            import torch
            torch.cuda.set_device(torch.device(device))
        yield


def default_device(dep: Deployment, index: int = 0) -> str:
    return f"cuda:{index}" if dep.device.kind is DeviceKind.CUDA else "cpu"


def device_name(device: str) -> str:
    """The accelerator's marketing name (GPU) or the CPU model, for memory scopes and reports."""
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(torch.device(device))
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return "cpu:" + " ".join(line.split(":", 1)[1].split())
    return "cpu:" + (platform.processor() or platform.machine() or "unknown")
