"""The captured decode step with and without a kernel table (or a PDL mode), measured together (the step gate's
timer), in both orders and at several contexts: is a table's step gain real, or the order or context it was measured
in?

    python3 scripts/gpu_step_ab.py OUT.json --shape smollm2-135m --table kt/summary.json --contexts 128,2048
    python3 scripts/gpu_step_ab.py OUT.json --shape llama3-8b --grid-dependency wait_then_trigger::wait_then_trigger_at_end
    python3 scripts/gpu_step_ab.py OUT.json --shape llama3-8b --base-table shipped.json --grid-dependency ...
    python3 scripts/gpu_step_ab.py OUT.json --shape llama3-8b --weight-format w12 --table kt/summary.json

--grid-dependency MODE[:PREFETCH_MIB[:LARGE_MODE]] (kernels.pdl.parse_grid_dependency): the "table" side is captured
in that mode for matrices within the prefetch budget (and LARGE_MODE for larger ones; default off), the default side
in the defaults. Prints one row per (context, T, order): default ms, table ms, default/table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specpilot.engines.config import WeightFormat
from specpilot.kernels.pdl import grid_dependency, parse_grid_dependency
from specpilot.kernels.table import read_pairs
from specpilot.stages.step_gate import step_timer
from specpilot.testbed.synthetic import ShapeName


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="smollm2-135m", choices=[s.value for s in ShapeName])
    ap.add_argument("--table", help="a tuner's summary.json (its kernel_table) or a pair list (default: none)")
    ap.add_argument("--base-table", help="the default side's kernel table (default: none); the table side takes "
                                         "--table, or this one when --table is not given")
    ap.add_argument("--grid-dependency", default="", help="MODE[:PREFETCH_MIB[:LARGE_MODE]] the table side is "
                                                          "captured in")
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda", help="cpu (TRITON_INTERPRET=1) checks the script, not speed")
    ap.add_argument("--weight-format", default="native", choices=[w.value for w in WeightFormat],
                    help="the weights both sides read (w12: bf16 only)")
    a = ap.parse_args(argv)
    if not a.table and not a.grid_dependency:
        ap.error("give --table, --grid-dependency or both")
    base = read_pairs(a.base_table) if a.base_table else ()
    pairs = read_pairs(a.table) if a.table else base
    side = (pairs,)
    if a.grid_dependency:
        try:
            kw = parse_grid_dependency(a.grid_dependency)
        except ValueError as e:
            ap.error(f"--grid-dependency: {e}")
        side = (pairs, lambda: grid_dependency(**kw))
    shape, dev = ShapeName(a.shape).shape, torch.device(a.device)
    wf = WeightFormat(a.weight_format)
    dtype = torch.bfloat16 if dev.type == "cuda" or wf is WeightFormat.W12 else torch.float32
    rows = []
    for ctx in (int(c) for c in a.contexts.split(",")):
        measure = step_timer(shape, dev, dtype, ctx, a.reps, rounds=a.rounds, weight_format=wf)
        for t in (int(x) for x in a.tokens.split(",")):
            for order in ("default first", "table first"):
                b = (side[0], t, *side[1:])
                configs = [(base, t), b] if order == "default first" else [b, (base, t)]
                ms = measure(configs)
                d, tb = (ms[0], ms[1]) if order == "default first" else (ms[1], ms[0])
                rows.append({"context": ctx, "tokens": t, "order": order, "default_ms": d, "table_ms": tb})
    a.out.write_text(json.dumps({"base_table": base, "table": pairs, "grid_dependency": a.grid_dependency,
                                 "weight_format": wf.value, "rows": rows}, indent=1))
    print("| context | T | order | default ms | table ms | default/table |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['tokens']} | {r['order']} | {r['default_ms']:.4f} | {r['table_ms']:.4f} | "
              f"{r['default_ms'] / r['table_ms']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
