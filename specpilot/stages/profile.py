"""Profile: AR and the current build on the tune prompts, kernels of its verify steps, its verify cost curve,
and the machine's ceilings measured on the spot (large copy, large matmul, per-op launch latency).

Writes outputs.json (token ids per variant and prompt), bench.json, steps.parquet (the build's steps),
requests.parquet (every request), kernels.parquet (torch.profiler over a few verify forwards: device time on
GPU, self CPU time on CPU), cost_curve.json, ceilings.json, shape.json, build.json and summary.json.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from torch.autograd import DeviceType

from specpilot.bench.harness import AR_LABEL, Variant, run_bench
from specpilot.bench.session import DeploymentSession, TokenizedPrompt
from specpilot.costmodel import Ceilings, classify_kernel
from specpilot.costmodel.classify import label_fused_launches
from specpilot.engines.runner import chain_anc
from specpilot.engines.family import shape_to_dict
from specpilot.engines.shapes import OpClass
from specpilot.engines.target_runner import TargetRunner, fresh_runner
from specpilot.engines.traces import KERNEL_SCHEMA, REQUEST_SCHEMA, STEP_SCHEMA, KernelTrace, to_table
from specpilot.stages.candidate import Candidate
from specpilot.stages.devices import device_name, exclusive
from specpilot.stages.io import SplitName, StageRun

BUILD_LABEL = "build"


@dataclass(frozen=True)
class ProfileParams:
    prompts: int = 0  # tune prompts (0: all)
    max_new_tokens: int = 0  # 0: the workload's
    kernel_steps: int = 4  # verify forwards under torch.profiler
    cost_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # verify widths of the cost curve
    cost_repeats: int = 3

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProfileParams":
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        return cls(**{**kept, "cost_tokens": tuple(kept.get("cost_tokens", cls.cost_tokens))})


@dataclass(frozen=True)
class MachineCeilings:
    device: str
    name: str
    dtype: str
    peak_flops: float  # FLOP/s of a large matmul in the deployment's dtype
    peak_bandwidth: float  # bytes/s of a large device-to-device copy (read + write)
    launch_latency_s: float  # wall time per tiny op (kernel launch on GPU, op dispatch on CPU)
    matmul_n: int
    copy_bytes: int

    def ceilings(self) -> Ceilings:
        return Ceilings(self.peak_flops, self.peak_bandwidth)


def _timed(fn, repeats: int, device: str) -> float:
    """Best wall time of `repeats` calls after one warm-up (synchronised on GPU)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_ceilings(device: str, dtype: torch.dtype) -> MachineCeilings:
    gpu = device.startswith("cuda")
    n, copy_bytes, repeats = (8192, 1 << 30, 10) if gpu else (1024, 1 << 27, 3)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops = 2.0 * n ** 3 / _timed(lambda: torch.mm(a, b), repeats, device)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    bandwidth = 2.0 * copy_bytes / _timed(lambda: dst.copy_(src), repeats, device)
    del a, b, src, dst
    x = torch.zeros(1, device=device)
    ops = 1000
    latency = _timed(lambda: [x.add_(1.0) for _ in range(ops)], 3, device) / ops
    return MachineCeilings(device, device_name(device), str(dtype).removeprefix("torch."), flops, bandwidth,
                           latency, n, copy_bytes)


def _chain(runner: TargetRunner, base: int, tokens: list[int]):
    n = len(tokens)
    return runner.verify(base, tokens, list(range(n)), chain_anc(n))


def measure_cost_curve(runner: TargetRunner, prompt: list[int], widths: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Median wall time of one verify of `t` chain tokens (after the prompt), for each width t."""
    runner.prefill(prompt)
    base, curve = len(prompt), {}
    for t in sorted({w for w in widths if 1 <= w <= runner.block_width}):
        tokens = [prompt[i % len(prompt)] for i in range(t)]
        _chain(runner, base, tokens)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _chain(runner, base, tokens)  # returns host lists: the step is complete
            times.append(time.perf_counter() - t0)
        curve[t] = statistics.median(times)
    # A wider verify never costs less than a narrower one (it does the narrower one's work and more); a noisy
    # inversion would make the cost model extrapolate negative costs, so each point is at least the previous.
    floor = 0.0
    for t in sorted(curve):
        curve[t] = floor = max(curve[t], floor)
    return curve


def profile_kernels(runner: TargetRunner, prompt: list[int], width: int, steps: int) -> list[KernelTrace]:
    """Kernels of `steps` verify forwards of `width` tokens: GPU kernels' device time, or CPU ops' self time."""
    gpu = runner.device.type == "cuda"
    runner.prefill(prompt)
    tokens = [prompt[i % len(prompt)] for i in range(width)]
    _chain(runner, len(prompt), tokens)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            _chain(runner, len(prompt), tokens)
    rows = _by_launch_role(prof, runner, steps, width) if gpu else []
    for evt in prof.key_averages() if not rows else ():
        if gpu:
            if evt.device_type != DeviceType.CUDA:
                continue
            seconds = evt.self_device_time_total * 1e-6
        else:
            seconds = evt.self_cpu_time_total * 1e-6
        if seconds <= 0.0 or evt.key.startswith(("ProfilerStep", "[")):
            continue
        ops = classify_kernel(evt.key)
        op = ops[0] if len(ops) == 1 else OpClass.OTHER
        rows.append(KernelTrace(evt.key, op.value, int(evt.count), seconds, steps, width))
    if not rows:
        raise RuntimeError("the profiler recorded no kernel time for the verify forwards")
    return sorted(rows, key=lambda k: -k.device_s)


def _by_launch_role(prof, runner: TargetRunner, steps: int, width: int) -> list[KernelTrace]:
    """GPU kernels per (name, op class), the fused forward's shared kernels split by their launch order
    (costmodel.label_fused_launches: QKV / gate_up / LM head, o_proj / down); [] when the launches do not line up
    with whole forwards (then the caller attributes by name)."""
    shape = getattr(getattr(runner, "model", None), "shape", None)
    launches = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name
                       and not e.name.startswith(("ProfilerStep", "["))), key=lambda e: e.time_range.start)
    labels = label_fused_launches([e.name for e in launches], getattr(shape, "layers", 0))
    if labels is None or not any(labels):
        return []
    totals: dict[tuple[str, str], list[float]] = {}
    for e, label in zip(launches, labels):
        if label is None:
            ops = classify_kernel(e.name)
            label = ops[0] if len(ops) == 1 else OpClass.OTHER
        acc = totals.setdefault((e.name, label.value), [0, 0.0])
        acc[0] += 1
        acc[1] += (e.time_range.end - e.time_range.start) * 1e-6
    return [KernelTrace(name, op, int(n), secs, steps, width) for (name, op), (n, secs) in totals.items() if secs > 0]


@dataclass(frozen=True)
class ProfileResult:
    build: Candidate
    speedup_vs_ar: float | None
    tokens_per_step: float
    all_match_ar: bool
    ceilings: MachineCeilings
    cost_curve: dict[int, float]  # seconds per verify forward
    kernel_width: int
    kernels: tuple[KernelTrace, ...]
    prompts: int
    max_new_tokens: int
    weight_bytes: float  # bytes the build's kernels read a projection weight (a W12 build: ~1.5, not its dtype's 2)


def profile(session: DeploymentSession, build: Candidate, prompts: list[TokenizedPrompt], params: ProfileParams,
            out_dir: Path) -> ProfileResult:
    policy = build.load_policy()  # refuses agent code: that runs only in the sandbox
    dep = session.deployment
    max_new = params.max_new_tokens or dep.workload.max_new_tokens
    variants = [Variant(AR_LABEL, dep.ar_config()), Variant(BUILD_LABEL, build.config, build.drafter_label, policy)]
    report, steps, requests = run_bench(session, prompts, variants, max_new, warmup=True)
    build_steps = steps.get(BUILD_LABEL, [])
    engine = session.engine(build.config, build.drafter_label, policy)
    runner = fresh_runner(engine.target, block_width=max(64, engine.target.block_width))  # either target family
    width = max((s.verify_tokens for s in build_steps), default=1)
    longest = max(prompts, key=lambda p: len(p.ids))
    kernels = profile_kernels(runner, list(longest.ids), width, params.kernel_steps)
    curve = measure_cost_curve(runner, list(longest.ids), params.cost_tokens, params.cost_repeats)
    del runner
    ceilings = measure_ceilings(session.device, dep.engine.dtype.torch)
    tps = [r.tokens_per_step for r in report.requests if r.variant == BUILD_LABEL]
    w12 = getattr(getattr(engine.target, "fused", None), "w12", None)  # a W12 build's kernel layouts
    weight_bytes = w12.bytes_per_weight() if w12 is not None else float(element_bytes(ceilings))
    result = ProfileResult(build, report.geomean(BUILD_LABEL), sum(tps) / len(tps), report.all_match(BUILD_LABEL),
                           ceilings, curve, width, tuple(kernels), len(prompts), max_new, weight_bytes)
    (out_dir / "outputs.json").write_text(json.dumps(report.outputs))
    (out_dir / "bench.json").write_text(json.dumps(report.to_dict(), indent=1))
    pq.write_table(to_table(build_steps, STEP_SCHEMA), out_dir / "steps.parquet")
    pq.write_table(to_table(requests, REQUEST_SCHEMA), out_dir / "requests.parquet")
    pq.write_table(to_table(kernels, KERNEL_SCHEMA), out_dir / "kernels.parquet")
    (out_dir / "cost_curve.json").write_text(json.dumps({"unit": "seconds per verify forward",
                                                         "points": {str(k): v for k, v in curve.items()}}, indent=1))
    (out_dir / "ceilings.json").write_text(json.dumps(asdict(ceilings), indent=1))
    (out_dir / "shape.json").write_text(json.dumps(shape_to_dict(session.target.shape), indent=1))
    (out_dir / "build.json").write_text(json.dumps(build.to_dict(), indent=1))
    (out_dir / "summary.json").write_text(json.dumps(summary(result), indent=1))
    return result


def summary(result: ProfileResult) -> dict[str, Any]:
    return {"build": result.build.name, "speedup_vs_ar": result.speedup_vs_ar, "tokens_per_step": result.tokens_per_step,
            "all_match_ar": result.all_match_ar, "prompts": result.prompts, "max_new_tokens": result.max_new_tokens,
            "kernel_width": result.kernel_width, "kernel_s_per_step": sum(k.device_s for k in result.kernels) / max(
                1, result.kernels[0].steps), "ceilings": asdict(result.ceilings),
            "weight_bytes": result.weight_bytes, "element_bytes": element_bytes(result.ceilings)}


def element_bytes(ceilings: MachineCeilings) -> int:
    """Bytes of an activation element in the dtype the ceilings were measured in."""
    return torch.finfo(getattr(torch, ceilings.dtype)).bits // 8


def run(run: StageRun) -> dict[str, Any]:
    params = ProfileParams.from_dict(run.request.params)
    build = Candidate.from_dict(run.param("build"))
    prompts = run.prompts(SplitName.TUNE, params.prompts)
    with exclusive(run.device):
        result = profile(run.session(), build, prompts, params, run.out_dir)
    return summary(result)
