"""Attribute: the cost model over one profile: tau, kernel and overhead factors, their product, ranked directions.

Reads the profile's steps.parquet, kernels.parquet, shape.json, ceilings.json (measured on the machine) and
cost_curve.json (measured verify times); writes attribution.json, report.md and attribution.png.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from specpilot.costmodel import Attribution, CostCurve, attribute, plot, render_markdown
from specpilot.engines.family import TargetShape, shape_from_dict
from specpilot.engines.traces import KernelTrace, StepTrace
from specpilot.stages.io import StageRun
from specpilot.stages.profile import MachineCeilings

PLOT_NAME = "attribution.png"


@dataclass(frozen=True)
class ProfileTraces:
    """What the cost model needs from one profile, decoded from its artifacts."""

    build: str
    steps: tuple[StepTrace, ...]
    kernels: tuple[KernelTrace, ...]
    shape: TargetShape  # either family: the cost model reads only its op_costs
    ceilings: MachineCeilings
    cost_curve: CostCurve
    element_bytes: int  # bytes per activation element in the deployment's dtype
    weight_bytes: float  # bytes the build's kernels read a projection weight (W12: its layouts' ~1.5)

    @classmethod
    def from_artifacts(cls, steps: pa.Table, kernels: pa.Table, shape: dict[str, Any], ceilings: dict[str, Any],
                       cost_curve: dict[str, Any], summary: dict[str, Any]) -> "ProfileTraces":
        points = {int(k): float(v) for k, v in cost_curve["points"].items()}
        return cls(summary["build"], tuple(StepTrace(**row) for row in steps.to_pylist()),
                   tuple(KernelTrace(**row) for row in kernels.to_pylist()), shape_from_dict(shape),
                   MachineCeilings(**ceilings), CostCurve.from_measured(points),
                   # profiles before session 31 wrote the dtype's bytes alone, as weight_bytes
                   int(summary.get("element_bytes", summary["weight_bytes"])), float(summary["weight_bytes"]))


def attribute_profile(traces: ProfileTraces) -> Attribution:
    return attribute(traces.steps, traces.kernels, traces.shape, traces.ceilings.ceilings(), traces.cost_curve,
                     weight_bytes=traces.weight_bytes, act_bytes=traces.element_bytes,
                     launch_latency_s=traces.ceilings.launch_latency_s)


def factors(attr: Attribution) -> dict[str, Any]:
    """The three factors as time ratios (>= 1: room to gain), their product and this round's direction."""
    return {"tau": attr.tau.tau, "tau_gap": attr.tau.gap, "kernel": attr.kernel.factor,
            "overhead": attr.overhead.factor, "total_gap": attr.total_gap, "direction": attr.directions[0].name.value,
            "rationale": attr.directions[0].rationale}


def write_attribution(attr: Attribution, traces: ProfileTraces, title: str, out_dir: Path) -> None:
    (out_dir / "attribution.json").write_text(json.dumps(attr.to_dict(), indent=1))
    plot(attr, out_dir / PLOT_NAME)
    c = traces.ceilings
    header = [f"# {title}", "",
              f"Build `{traces.build}` on {c.name}. Ceilings measured at profile time: {c.peak_flops / 1e9:.1f} GFLOP/s "
              f"({c.dtype} {c.matmul_n}x{c.matmul_n} matmul), {c.peak_bandwidth / 1e9:.1f} GB/s (copy of "
              f"{c.copy_bytes >> 20} MiB), {c.launch_latency_s * 1e6:.2f} us per op launch. "
              f"This round's direction: **{attr.directions[0].name.value}**.", "",
              f"![factors and per-op-class time]({PLOT_NAME})", ""]
    (out_dir / "report.md").write_text("\n".join(header) + render_markdown(attr))


def run(run: StageRun) -> dict[str, Any]:
    """Inputs: profile; optionally `ceilings`, an earlier profile whose measured ceilings to judge this one by. A
    before/after comparison must share them: the copy bandwidth measured at profile time moves ~5% between runs on
    an H200, and every ideal time with it (a kernel tuning round once "narrowed" the kernel factor 1.21x -> 1.15x
    that way while the kernels' time changed 0.4%)."""
    ceilings_from = "ceilings" if "ceilings" in run.request.inputs else "profile"
    traces = ProfileTraces.from_artifacts(
        run.read_table("profile", "steps.parquet"), run.read_table("profile", "kernels.parquet"),
        run.read_json("profile", "shape.json"), run.read_json(ceilings_from, "ceilings.json"),
        run.read_json("profile", "cost_curve.json"), run.read_json("profile", "summary.json"))
    attr = attribute_profile(traces)
    title = f"Attribution: {run.deployment.name}, {' '.join(run.request.qualifiers) or 'profile'}"
    write_attribution(attr, traces, title, run.out_dir)
    return factors(attr)
