"""Run agent-written policy code isolated from the orchestrator: a child process per run, never in-process.

Each run gets a fresh directory RUN (a copy of the policy file, request.json, result.json) and a child
`python -I -B specpilot/agents/child.py RUN` with cwd = RUN, an environment holding only PATH, HOME=TMPDIR=RUN,
locale and thread counts, and these layers (see guard.py for the in-process ones):
- resource limits: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_NOFILE, RLIMIT_FSIZE, no core dumps; a wall-clock
  timeout that kills the whole process group;
- Isolation.NAMESPACE (where unprivileged user namespaces work): `unshare --user --map-root-user --net`,
  so the process has no network interface but a down loopback; Isolation.CONTAINER (an image configured
  and a Docker daemon reachable): `docker run --network none --read-only --cap-drop ALL` with the same limits;
  Isolation.PROCESS otherwise (network then blocked by Landlock's TCP rules and the audit hook only);
- Landlock: writes only beneath RUN; reads only beneath RUN, Python's installation and environment, the
  specpilot package and system libraries; TCP connect/bind denied; no signals out of the sandbox (by kernel ABI);
- an audit hook turning network, process, ctypes and out-of-directory write attempts into PermissionError,
  each attempt also written to stderr (kept outside RUN, so the code cannot erase it).
Limits, honestly: without Landlock (kernels < 5.13) reads are not restricted (the orchestrator's
/proc/<pid>/environ is then shielded only by the user namespace) and C extensions that write files without audit
events (torch.save) are not stopped; what the code can read leaves only through its result and error text, which
the parent parses as tokens and timings and passes (truncated) to the agent; UDP and raw sockets are stopped by
the namespace and the hook, not by Landlock; timings come from the untrusted process and are only as
trustworthy as it is (tokens are checked by the parent). On CUDA
the child shares the GPU with the orchestrator (no device-memory isolation), gets no address-space limit (CUDA
reserves huge virtual ranges), may write only its /dev/nvidia* device files beyond RUN, and compiles its
Triton kernels before locking down: a kernel first needed afterwards cannot compile (spawning ptxas is blocked);
likewise torch.compile (compile=True), whose inductor spawns compile workers. Block-drafter (DFlash) candidates
are not sandboxed yet: TargetSpec carries a target and a draft model, not a block drafter checkpoint.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

from specpilot.agents.guard import VIOLATION_MARK
from specpilot.agents.protocol import (ChildMode, ChildRequest, ChildStatus, ForcedRun, GeneratedRun, PromptIds,
                                       SandboxOutcome, SandboxStatus, TargetSpec, Violation)
from specpilot.stages.candidate import Candidate

CHILD = Path(__file__).resolve().parent / "child.py"
PACKAGE_ROOT = CHILD.parents[2]
PASS_THROUGH_ENV = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")  # how the child should run kernels, nothing else
MAX_VIOLATIONS = 20


class Isolation(str, Enum):
    CONTAINER = "container"
    NAMESPACE = "namespace"
    PROCESS = "process"


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 180.0
    cpu_s: int = 300
    memory_bytes: int = 8 << 30  # address space: torch maps ~1 GiB of libraries before allocating anything
    max_open_files: int = 256
    max_file_bytes: int = 64 << 20
    container_image: str | None = None  # an image with torch and specpilot's dependencies (containers/)


@functools.cache
def _works(*argv: str) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def detect_isolation(limits: SandboxLimits) -> Isolation:
    """The strongest isolation this host offers for the given limits."""
    if limits.container_image and shutil.which("docker") and _works("docker", "info"):
        return Isolation.CONTAINER
    if shutil.which("unshare") and _works("unshare", "--user", "--map-root-user", "--net", "true"):
        return Isolation.NAMESPACE
    return Isolation.PROCESS


def _set_limits(limits: SandboxLimits, cuda: bool) -> None:
    """In the child between fork and exec: soft = hard, so the code cannot raise them again. No address-space
    limit on CUDA: a CUDA context reserves far more virtual memory than any host would allow."""
    pairs = [(resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_NOFILE, limits.max_open_files),
             (resource.RLIMIT_FSIZE, limits.max_file_bytes), (resource.RLIMIT_CORE, 0)]
    for which, value in pairs + ([] if cuda else [(resource.RLIMIT_AS, limits.memory_bytes)]):
        resource.setrlimit(which, (value, value))


def child_env(run_dir: Path, threads: int, cache_dir: Path) -> dict[str, str]:
    # cache_dir: caches the trusted imports write once (matplotlib's font list), before the child locks down
    env = {"PATH": "/usr/bin:/bin", "HOME": str(run_dir), "TMPDIR": str(run_dir), "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "MPLCONFIGDIR": str(cache_dir),
           "MPLBACKEND": "Agg", "TRITON_CACHE_DIR": str(cache_dir / "triton")}
    return env | {k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ}


def docker_argv(limits: SandboxLimits, run_dir: Path, target: TargetSpec, threads: int, cache_dir: Path) -> list[str]:
    """`docker run` with no network, a read-only root, no capabilities, the limits, and only RUN writable."""
    if not limits.container_image:
        raise ValueError("container isolation needs SandboxLimits.container_image")
    mounts = [f"{run_dir}:{run_dir}:rw", f"{cache_dir}:{cache_dir}:rw", f"{PACKAGE_ROOT}:{PACKAGE_ROOT}:ro"]
    mounts += [f"{p}:{p}:ro" for p in target.readable_paths()]
    argv = ["docker", "run", "--rm", "--network", "none", "--read-only", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--user", f"{os.getuid()}:{os.getgid()}",
            "--memory", str(limits.memory_bytes), "--memory-swap", str(limits.memory_bytes), "--pids-limit", "256",
            "--cpus", str(threads), "--ulimit", f"cpu={limits.cpu_s}",
            "--ulimit", f"nofile={limits.max_open_files}:{limits.max_open_files}",
            "--ulimit", f"fsize={limits.max_file_bytes}", "--workdir", str(run_dir)]
    for m in mounts:
        argv += ["--volume", m]
    for k, v in child_env(run_dir, threads, cache_dir).items():
        argv += ["--env", f"{k}={v}"]
    return argv + [limits.container_image, "python", "-I", "-B", str(CHILD), str(run_dir)]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip(".-")[:80] or "candidate"


class SandboxedPolicyRunner:
    """Runs candidates whose policy is agent code in the sandbox; the parent keeps the reference."""

    def __init__(self, target: TargetSpec, root: str | Path, limits: SandboxLimits = SandboxLimits(),
                 isolation: Isolation | None = None, threads: int | None = None):
        import torch

        self.target, self.limits = target, limits
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache_dir = self.root / ".cache"
        self.cache_dir.mkdir(exist_ok=True)
        self.isolation = isolation or detect_isolation(limits)
        self.threads = threads or torch.get_num_threads()
        self._runs = 0

    def write_policy(self, name: str, code: str, class_name: str) -> str:
        """Store agent code (never imported here) and return the Candidate.policy reference to it."""
        if not class_name.isidentifier():
            raise ValueError(f"policy class name {class_name!r} is not a Python identifier")
        digest = hashlib.sha256(f"{class_name}\n{code}".encode()).hexdigest()[:10]
        path = self.root / f"{_slug(name)}-{digest}" / "policy.py"  # content-addressed: a candidate's code never changes
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        return f"{path}:{class_name}"

    def generate(self, candidate: Candidate, prompts: Sequence[PromptIds], max_new_tokens: int) -> SandboxOutcome:
        return self._launch(candidate, ChildMode.GENERATE, prompts, max_new_tokens, {})

    def forced(self, candidate: Candidate, prompts: Sequence[PromptIds],
               stock_outputs: dict[str, list[int]]) -> SandboxOutcome:
        longest = max(len(v) for v in stock_outputs.values())
        return self._launch(candidate, ChildMode.FORCED, prompts, max(1, longest), stock_outputs)

    def _launch(self, candidate: Candidate, mode: ChildMode, prompts: Sequence[PromptIds], max_new_tokens: int,
                stock_outputs: dict[str, list[int]]) -> SandboxOutcome:
        if candidate.policy is None:
            raise ValueError(f"candidate {candidate.name} has no policy code to sandbox")
        self._runs += 1
        base = self.root / _slug(candidate.name) / "runs"
        run_dir = base / f"{self._runs:03d}-{mode.value}"
        run_dir.mkdir(parents=True)
        target, cls = candidate.policy.rsplit(":", 1)
        policy = candidate.policy
        if target.endswith(".py"):  # a fresh copy per run: nothing a run writes survives into the next one
            shutil.copyfile(target, run_dir / "policy.py")
            policy = f"{run_dir / 'policy.py'}:{cls}"
        cuda = self.target.device.startswith("cuda")
        extra = tuple(sorted(glob.glob("/dev/nvidia*"))) if cuda else ()  # CUDA opens its device files read-write
        readable = (str(self.cache_dir),) + (("/proc/driver/nvidia", "/sys") if cuda else ())
        request = ChildRequest(mode, policy, candidate.config, self.target,
                               tuple(PromptIds(p.key, tuple(p.ids)) for p in prompts), max_new_tokens, self.threads,
                               stock_outputs, extra, readable)
        (run_dir / "request.json").write_text(json.dumps(request.to_dict()))
        if self.isolation is Isolation.CONTAINER:
            argv, preexec = docker_argv(self.limits, run_dir, self.target, self.threads, self.cache_dir), None
        else:
            prefix = ["unshare", "--user", "--map-root-user", "--net", "--"] if self.isolation is Isolation.NAMESPACE else []
            argv = prefix + [sys.executable, "-I", "-B", str(CHILD), str(run_dir)]
            preexec = functools.partial(_set_limits, self.limits, cuda)
        out_path, err_path = base / f"{run_dir.name}.stdout", base / f"{run_dir.name}.stderr"
        start = time.perf_counter()
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, cwd=run_dir, env=child_env(run_dir, self.threads, self.cache_dir),
                                    stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, preexec_fn=preexec, start_new_session=True)
            try:
                proc.wait(timeout=self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.perf_counter() - start
        return _outcome(run_dir, err_path, self.isolation, proc.returncode, wall, timed_out, self.limits)


def _violations(stderr: str) -> tuple[Violation, ...]:
    out = []
    for line in stderr.splitlines():
        if line.startswith(VIOLATION_MARK):
            try:
                d = json.loads(line[len(VIOLATION_MARK):])
                out.append(Violation(str(d["event"]), str(d["detail"])))
            except (ValueError, KeyError):
                out.append(Violation("unparsed", line[len(VIOLATION_MARK):][:300]))
    if len(out) > MAX_VIOLATIONS:  # the list goes back to the agent: bounded, whatever the code attempts
        out = out[:MAX_VIOLATIONS] + [Violation("more", f"{len(out) - MAX_VIOLATIONS} more blocked attempts")]
    return tuple(out)


def _read_result(run_dir: Path, limit: int) -> dict[str, Any] | None:
    path = run_dir / "result.json"
    if not path.is_file() or path.stat().st_size > limit:
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _outcome(run_dir: Path, err_path: Path, isolation: Isolation, rc: int, wall: float, timed_out: bool,
             limits: SandboxLimits) -> SandboxOutcome:
    stderr = err_path.read_text(errors="replace")
    violations = _violations(stderr)
    result = _read_result(run_dir, limits.max_file_bytes)
    layers = ("rlimits", *(("netns",) if isolation is Isolation.NAMESPACE else ()),
              *(("container",) if isolation is Isolation.CONTAINER else ()),
              *((result or {}).get("layers") or ()))
    error = ""
    if result is not None and result.get("status") == ChildStatus.ERROR.value:
        e = result.get("error") or {}
        error = f"{e.get('type', 'Error')}: {e.get('message', '')}"
    if timed_out:
        status, error = SandboxStatus.TIMEOUT, f"wall-clock limit of {limits.wall_s:g} s exceeded"
    elif violations or error.startswith("PermissionError"):
        status = SandboxStatus.VIOLATION
    elif rc == -signal.SIGXCPU and result is None:
        status, error = SandboxStatus.CPU_LIMIT, f"CPU time limit of {limits.cpu_s} s exceeded"
    elif error.startswith("MemoryError") or (result is None and "MemoryError" in stderr):
        status, error = SandboxStatus.MEMORY_LIMIT, error or f"address-space limit of {limits.memory_bytes} bytes exceeded"
    elif result is None:
        status, error = SandboxStatus.CRASHED, f"exited with code {rc} without a readable result: {stderr[-500:]}"
    else:
        status = SandboxStatus.OK if result.get("status") == ChildStatus.OK.value else SandboxStatus.ERROR
    runs, forced = (), ()
    if status is SandboxStatus.OK:
        try:  # the result comes from the untrusted process: parse it strictly
            runs = tuple(GeneratedRun.from_dict(r) for r in result.get("runs", ()))
            forced = tuple(ForcedRun.from_dict(r) for r in result.get("forced", ()))
        except (KeyError, TypeError, ValueError) as e:
            status, error = SandboxStatus.CRASHED, f"malformed result.json: {type(e).__name__}: {e}"
    return SandboxOutcome(status, str(run_dir), isolation, tuple(dict.fromkeys(layers)), rc, wall, violations,
                          error, runs, forced)
