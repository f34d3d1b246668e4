"""Two explore tasks on two GPUs at the same time: a one-round tune of a random-weight SmolLM2-135M-shaped
deployment with `gpus=2` on an ephemeral Prefect API, then the explore timeline (task, GPU, start, end) read
back from the stage manifests, the overlap of the two windows and each GPU's utilisation while they overlap.

Random weights say nothing about acceptance; this run proves the scheduling (one explore task pinned to each
GPU, both running at once), not a speedup. Run it through scripts/gpu_two_explorers.sh on the GPU host, which
installs the carried wheels first. `--device cpu` runs the same path on one CPU explore task (a local check
of the wheelhouse: imports, ephemeral Prefect, store, memory), where there is nothing to overlap.

Exit status: 0 when every check holds, 1 when a check fails, 2 when the environment is incomplete.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RunConfig:
    out: Path  # the timeline only (the device tool brings back a few files)
    scratch: Path  # deployment, store, memory and stage outputs
    device: str  # "cuda" or "cpu"
    gpus: int
    trials: int
    max_new_tokens: int
    site: Path | None  # the --target dir the wheels went to; its packages' requirements are checked


@dataclass(frozen=True)
class TimelineRow:
    task: str
    device: str
    gpu_name: str
    started: str
    finished: str
    seconds: float
    mean_util_pct: float | None  # the task's GPU, sampled over the task's window


def check_requirements(site: Path, left_out: frozenset[str] = frozenset()) -> tuple[list[str], set[str]]:
    """Every distribution installed in `site` has its requirements met by what is importable now (the site
    first, then the host's own packages), versions included: the offline install has no resolver. Returns the
    unmet requirements and the absent ones the wheelhouse left out on purpose (never imported by a run)."""
    from importlib.metadata import PackageNotFoundError, distribution, distributions

    from packaging.requirements import Requirement
    from packaging.version import Version

    problems, skipped = [], set()
    for dist in distributions(path=[str(site)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                found = distribution(req.name).version
            except PackageNotFoundError:
                if _norm(req.name) in left_out:
                    skipped.add(_norm(req.name))
                else:
                    problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(Version(found), prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req}: found {req.name} {found}")
    return problems, skipped


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def write_deployment(root: Path, cfg: RunConfig) -> Path:
    if cfg.device == "cuda":
        target, device, engine = ("{random: smollm2-135m, seed: 0}", f"{{kind: cuda, gpu: H200, count: {cfg.gpus}}}",
                                  "{dtype: bfloat16, cuda_graphs: true, max_seq_len: 2048, kernel_backend: triton}")
    else:
        target, device, engine = "{random: tiny, seed: 0}", "{kind: cpu}", "{dtype: float32, cuda_graphs: false}"
    path = root / "two-explorers.yaml"
    path.write_text(f"""name: two-explorers-{cfg.device}
description: random weights, for the multi-GPU exploration timeline only (no acceptance, no speedup claims)
target: {target}
drafters:
  - kind: ngram
device: {device}
regime: {{kind: single}}
workload: {{benchmarks: [humaneval, mt_bench], prompts_per_benchmark: 2, max_new_tokens: {cfg.max_new_tokens}, seed: 0}}
engine: {engine}
""")
    return path


class GpuSampler(threading.Thread):
    """Utilisation of each GPU every 0.2 s (NVML through torch), to show both GPUs busy during the overlap."""

    def __init__(self, gpus: int):
        super().__init__(daemon=True)
        self.gpus, self.samples, self._halt = gpus, [], threading.Event()

    def run(self) -> None:
        import torch
        while not self._halt.is_set():
            try:
                self.samples.append((time.time(), [torch.cuda.utilization(i) for i in range(self.gpus)]))
            except Exception as e:  # no NVML: the timeline still stands on its own
                print(f"GPU sampling stopped: {type(e).__name__}: {e}", file=sys.stderr)
                return
            self._halt.wait(0.2)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def mean(self, gpu: int, start: float, end: float) -> float | None:
        values = [u[gpu] for t, u in self.samples if start <= t <= end]
        return round(sum(values) / len(values), 1) if values else None


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def explore_timeline(store_uri: str, run_id: str, sampler: GpuSampler | None) -> tuple[list[TimelineRow], bool]:
    """The run's explore stages from their manifests (timing recorded by the stage framework); also whether
    the whole run audits clean."""
    from specpilot.artifacts import audit_run, store_from_uri
    from specpilot.stages.devices import device_name

    report = audit_run(store_from_uri(store_uri), f"runs/{run_id}")
    rows = []
    for stage in report.stages:
        timing = stage.manifest.meta.get("timing")
        if stage.manifest.stage != "explore" or not timing:
            continue
        device = timing["device"]
        util = None
        if sampler is not None and device.startswith("cuda:"):
            util = sampler.mean(int(device.split(":")[1]), _epoch(timing["started"]), _epoch(timing["finished"]))
        label = "explore-" + "-".join(stage.manifest.meta["request"]["qualifiers"])
        rows.append(TimelineRow(label, device, device_name(device), timing["started"], timing["finished"],
                                round(_epoch(timing["finished"]) - _epoch(timing["started"]), 2), util))
    return sorted(rows, key=lambda r: r.started), report.ok


def format_timeline(rows: list[TimelineRow]) -> str:
    t0 = min(_epoch(r.started) for r in rows)
    lines = ["| task | device | GPU | start (UTC) | end (UTC) | start +s | end +s | seconds | mean util % |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.task} | {r.device} | {r.gpu_name} | {r.started[11:23]} | {r.finished[11:23]} | "
                     f"{_epoch(r.started) - t0:.2f} | {_epoch(r.finished) - t0:.2f} | {r.seconds:.2f} | "
                     f"{'-' if r.mean_util_pct is None else r.mean_util_pct} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/two-explorers"))
    parser.add_argument("--scratch", type=Path, default=None, help="store, memory, stage outputs (default: a temp dir)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--trials", type=int, default=8, help="search trials per explore task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1,
                        help="tune rounds; with 2+ the kernel tuner runs between rounds and the table shows each "
                             "round's kernel factor (the before/after attribution of issue 10)")
    parser.add_argument("--site", type=Path, default=None, help="where the carried wheels were installed")
    parser.add_argument("--left-out", type=Path, default=None, help="the wheelhouse's left-out.txt")
    a = parser.parse_args(argv)
    scratch = (a.scratch or Path(tempfile.mkdtemp(prefix="two-explorers-"))).resolve()
    cfg = RunConfig(a.out.resolve(), scratch, a.device, a.gpus if a.device == "cuda" else 1, a.trials, a.max_new_tokens, a.site)
    cfg.out.mkdir(parents=True, exist_ok=True)
    cfg.scratch.mkdir(parents=True, exist_ok=True)

    if cfg.site is not None:
        left_out = frozenset(_norm(line.split("\t")[0]) for line in a.left_out.read_text().splitlines()
                             if line.strip()) if a.left_out else frozenset()
        problems, skipped = check_requirements(cfg.site, left_out)
        print(f"requirements of the packages in {cfg.site}: " + ("all met" if not problems else "UNMET")
              + (f" (left out on purpose, never imported: {', '.join(sorted(skipped))})" if skipped else ""))
        if problems:
            print("\n".join("  " + p for p in problems))
            return 2
    import torch
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda devices: {torch.cuda.device_count()}")
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.gpus:
        print(f"needs {cfg.gpus} visible GPUs, found {torch.cuda.device_count()}")
        return 2

    from specpilot.flows.report import TuneReport
    from specpilot.flows.tune import tune

    deployment = write_deployment(cfg.scratch, cfg)
    short = max(16, cfg.max_new_tokens // 2)
    overrides = {"profile": {"prompts": 2, "max_new_tokens": short, "cost_repeats": 2},
                 "explore": {"prompts": 2, "max_new_tokens": cfg.max_new_tokens, "trials": cfg.trials, "batch": 4},
                 "validate": {"prompts": 2, "max_new_tokens": short},
                 "integrate": {"heldout_prompts": 2, "heldout_max_new_tokens": short}}
    sampler = GpuSampler(cfg.gpus) if cfg.device == "cuda" else None
    if sampler:
        sampler.start()
    started = time.time()
    try:
        result = tune(str(deployment), rounds=a.rounds, gpus=cfg.gpus, store=str(cfg.scratch / "store"),
                      memory=str(cfg.scratch / "memory.duckdb"), work_dir=str(cfg.scratch / "work"),
                      overrides=overrides)
    finally:
        if sampler:
            sampler.stop()
    report = TuneReport.from_dict(result)
    print(f"tune {report.run_id} finished in {time.time() - started:.1f} s; store {report.store}")
    print(report.table())  # per round: tau gap, kernel factor, overhead factor (before/after the kernel tuner)

    rows, audit_ok = explore_timeline(report.store, report.run_id, sampler)
    table = format_timeline(rows)
    checks = {"audit of every artifact": audit_ok}
    rounds: dict[str, list[TimelineRow]] = {}
    for r in rows:  # task labels are explore-round<N>-dev<i>
        rounds.setdefault(r.task.rsplit("-", 1)[0], []).append(r)
    checks[f"{a.rounds} round(s) of explore tasks"] = len(rounds) == a.rounds
    overlaps = {}
    for name, group in sorted(rounds.items()):
        devices = [r.device for r in group]
        checks[f"{name}: {cfg.gpus} task(s), one per device ({', '.join(devices)})"] = (
            len(group) == cfg.gpus and len(set(devices)) == cfg.gpus
            and (cfg.device == "cpu" or sorted(devices) == [f"cuda:{i}" for i in range(cfg.gpus)]))
        if cfg.gpus > 1:
            overlaps[name] = min(_epoch(r.finished) for r in group) - max(_epoch(r.started) for r in group)
            checks[f"{name}: explore windows overlap ({overlaps[name]:.2f} s)"] = overlaps[name] > 0
    print("\n" + table + "\n")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    (cfg.out / "timeline.md").write_text(table + "\n")
    (cfg.out / "timeline.json").write_text(json.dumps({
        "run_id": report.run_id, "rows": [asdict(r) for r in rows], "overlap_s": overlaps, "checks": checks,
        "gpu_samples": sampler.samples if sampler else []}, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
