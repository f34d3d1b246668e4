"""The kernel tuner's proof on one GPU, without Prefect or a memory database (neither is on the H200 host):
profile the stock build, attribute, tune the kernels furthest from their bound, profile the tuned build, attribute
again. Prints the kernel factor and each op class's time and gap before and after, and the table's entries with
their re-timed default and tuned times. Random-weight deployments are fine here: the tuner and the kernel factor
are about kernels and cost, not acceptance. (--device cpu --allow-cpu under TRITON_INTERPRET=1 checks the logic
on a tiny deployment; its timings mean nothing.)

    python3 scripts/gpu_kernel_tuning.py OUT [--deployment llama8b-shape-h200] [--budget '{"max_settings": 16}']
        [--from-defaults] [--weight-format w12]

Writes OUT/<stage>/<round>/... (every stage's artifacts, as the flow would) and OUT/summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import sys
import time
from pathlib import Path

from specpilot.costmodel import Attribution
from specpilot.deployments import load_deployment
from specpilot.engines.config import WeightFormat
from specpilot.stages import catalog
from specpilot.stages.candidate import Candidate
from specpilot.stages.io import StageName, StageRequest, run_stage

PROFILE = {"prompts": 2, "max_new_tokens": 64, "kernel_steps": 4, "cost_tokens": [1, 2, 4, 8, 16], "cost_repeats": 3}


def op_rows(attr: Attribution) -> dict[str, dict[str, float | None]]:
    return {g.op.value: {"us": g.measured_s * 1e6, "ideal_us": g.ideal_s * 1e6, "gap": g.gap}
            for g in attr.kernel.op_gaps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--deployment", default="llama8b-shape-h200")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--budget", default="{}", help="TuneBudget fields as JSON")
    ap.add_argument("--profile", default=json.dumps(PROFILE), help="profile stage params as JSON")
    ap.add_argument("--allow-cpu", action="store_true", help="let the tuner run interpreted kernels (logic check)")
    ap.add_argument("--from-defaults", action="store_true",
                    help="start from the default launches, not the deployment's kernel table (does the tuner find "
                         "that table by itself?)")
    ap.add_argument("--weight-format", choices=[f.value for f in WeightFormat], default=None,
                    help="the stock build's weight format (w12: the tuner times the projections on W12 weights)")
    ap.add_argument("--dump-stacks-after", type=float, default=0.0,
                    help="seconds after which every thread's stack goes to stderr (a hang shows where it is)")
    a = ap.parse_args(argv)
    if a.dump_stacks_after > 0:
        faulthandler.dump_traceback_later(a.dump_stacks_after)
    dep = load_deployment(a.deployment)
    stock = catalog.stock_candidate(dep)
    if a.from_defaults:
        stock = dataclasses.replace(stock, config=stock.config.replace(kernel_table=()))
    if a.weight_format:
        stock = dataclasses.replace(stock, config=stock.config.replace(weight_format=WeightFormat(a.weight_format)))
    run_id = time.strftime("%Y%m%dT%H%M%SZ-kt", time.gmtime())
    store = (a.out / "store").resolve().as_uri()
    profile_params = json.loads(a.profile)

    def stage(name: StageName, qualifiers: tuple[str, ...], params: dict, inputs: dict | None = None):
        return run_stage(StageRequest(name, run_id, a.deployment, store, inputs or {}, params, qualifiers, a.device),
                         a.out.joinpath(name.value, *qualifiers))

    def profile_and_attribute(build: Candidate, q: str, ceilings_from=None):
        prof = stage(StageName.PROFILE, (q,), {**profile_params, "build": build.to_dict()})
        attr = stage(StageName.ATTRIBUTE, (q,), {}, {"profile": prof.manifest_uri,
                                                     "ceilings": (ceilings_from or prof).manifest_uri})
        return prof, attr, Attribution.from_dict(json.loads(Path(attr.out_dir, "attribution.json").read_text()))

    t0 = time.time()
    prof0, attr0_run, before = profile_and_attribute(stock, "before")
    print(f"before: kernel factor {before.kernel.factor:.3f}x; ops (us/step, gap): "
          + ", ".join(f"{op} {r['us']:.1f} {r['gap'] or 0:.2f}x" for op, r in op_rows(before).items()), flush=True)
    tuned_run = stage(StageName.TUNE_KERNELS, ("round1",), {"budget": json.loads(a.budget), "allow_cpu": a.allow_cpu},
                      {"profile": prof0.manifest_uri, "attribute": attr0_run.manifest_uri})
    tuned = Candidate.from_dict(json.loads(Path(tuned_run.out_dir, "build.json").read_text()))
    table = json.loads(Path(tuned_run.out_dir, "kernel_table.json").read_text())
    _, _, after = profile_and_attribute(tuned, "after", ceilings_from=prof0)  # one yardstick for both

    rows_b, rows_a = op_rows(before), op_rows(after)
    summary = {"deployment": dep.name, "device": a.device, "seconds": round(time.time() - t0, 1),
               "kernel_factor": {"before": before.kernel.factor, "after": after.kernel.factor},
               "total_gap": {"before": before.total_gap, "after": after.total_gap},
               # the kernels' own time per step: what the table changed, whatever the ceilings
               "kernel_us_per_step": {"before": sum(r["us"] for r in rows_b.values()),
                                      "after": sum(r["us"] for r in rows_a.values())},
               "ops": {op: {"before": rows_b[op], "after": rows_a.get(op)} for op in rows_b},
               "selected": [c["kernel"] for c in table["selected"]],
               "entries": [{k: e[k] for k in ("kernel", "n", "k", "tokens", "params", "default_ms", "tuned_ms")}
                           for e in table["entries"]],
               "refused": len(table["refused"]), "kernel_table": [list(p) for p in tuned.config.kernel_table],
               "step_gate": {"step": table.get("step", {}),
                             "dropped": [r for r in table["refused"] if r.startswith("step gate:")]}}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{dep.name} on {a.device}: kernel factor {before.kernel.factor:.3f}x -> {after.kernel.factor:.3f}x, "
          f"total gap {before.total_gap:.2f}x -> {after.total_gap:.2f}x; kernels "
          f"{summary['kernel_us_per_step']['before']:.1f} -> {summary['kernel_us_per_step']['after']:.1f} us/step; "
          f"tuned {summary['selected']}")
    print("| op class | before us/step | after us/step | gap before | gap after |\n|---|---|---|---|---|")
    for op, r in summary["ops"].items():
        af = r["after"] or {}
        gb, ga = r["before"]["gap"], af.get("gap")
        print(f"| {op} | {r['before']['us']:.1f} | {af.get('us', float('nan')):.1f} | "
              f"{'-' if gb is None else f'{gb:.2f}x'} | {'-' if ga is None else f'{ga:.2f}x'} |")
    print("| kernel@shape@T | default ms | tuned ms | params |\n|---|---|---|---|")
    for e in summary["entries"]:
        ms = [("step option" if v is None else f"{v:.4f}") for v in (e["default_ms"], e["tuned_ms"])]
        print(f"| {e['kernel']}@{e['n']}x{e['k']}@T{e['tokens']} | {ms[0]} | {ms[1]} | "
              f"{json.dumps(e['params'], sort_keys=True)} |")
    gate = summary["step_gate"]
    for o in gate["step"].get("options", []):
        print(f"step option {o['option']}: T={o['tokens']} step ms {o['without_ms']} without -> {o['with_ms']} with "
              f"(gain {o['gain']:.4f}, {'kept' if o['kept'] else 'dropped'})")
    if "gain" in gate["step"]:
        print(f"step gate: T={gate['step']['tokens']} step ms {gate['step']['default_ms']} default -> "
              f"{gate['step']['tuned_ms']} with the kept entries (gain {gate['step']['gain']:.4f})")
    for d in gate["dropped"]:
        print(f"  dropped: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
