"""A kernel table with some launch fields changed, for a captured-step A/B (scripts/gpu_step_ab.py --table).

    python3 scripts/table_variant.py OUT.json --shape llama3-8b --base shipped.json \
        --set qkv,gate_up,lm_head:producer_stat=true [--set o_proj:block_n=32 ...]
    python3 scripts/table_variant.py OUT.json --shape smollm2-135m --deployment smollm2-135m-h200 \
        --set attention@128:num_warps=8 --set qkv@128,lm_head@128:tile_rows=32

Each --set gives every entry of those kernels at the shape's (N, K) the fields (JSON values), at every T the base
table has for it, or at T=1 where it has none: an order-setting field then holds for every T of the shape, as
check_invariance requires (the result is checked before it is written). KERNEL@T: that T's entry only (a T-neutral
field; one the base lacks starts from no fields, so an order-setting field the shape's other entries hold fails the
check). --deployment: its engine's kernel table as the base.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specpilot.kernels.table import read_pairs, with_fields
from specpilot.testbed.synthetic import ShapeName


def dims(shape, kernel: str) -> tuple[int, int]:
    from specpilot.stages.kernel_specs import BY_NAME
    if kernel not in BY_NAME:
        raise SystemExit(f"unknown kernel {kernel!r} (known: {', '.join(BY_NAME)})")
    return BY_NAME[kernel].dims(shape)


def parse_set(text: str) -> tuple[list[str], dict]:
    try:
        kernels, assigns = text.split(":", 1)
        fields = {k: json.loads(v) for k, v in (a.split("=", 1) for a in assigns.split(";"))}
    except ValueError as e:
        raise SystemExit(f"--set {text!r}: want KERNEL[,KERNEL...]:FIELD=JSON[;FIELD=JSON...] ({e})") from None
    return kernels.split(","), fields


def variant(pairs, shape, sets) -> list[tuple[str, str]]:
    for kernels, fields in sets:
        for spec in kernels:
            kernel, _, t = spec.partition("@")
            pairs = with_fields(pairs, kernel, *dims(shape, kernel), fields, int(t) if t else None)
    return list(pairs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama3-8b", choices=[s.value for s in ShapeName])
    ap.add_argument("--base", help="the table to start from (a pair list or a tuner summary.json); default: empty")
    ap.add_argument("--deployment", help="start from this deployment's engine kernel table instead")
    ap.add_argument("--set", action="append", default=[], help="KERNELS:FIELD=JSON[;FIELD=JSON]")
    a = ap.parse_args(argv)
    if a.deployment:
        from specpilot.deployments import load_deployment
        pairs = tuple(load_deployment(a.deployment).engine.kernel_table)
    else:
        pairs = read_pairs(a.base) if a.base else ()
    out = variant(pairs, ShapeName(a.shape).shape, [parse_set(s) for s in a.set])
    a.out.write_text(json.dumps(out, indent=1))
    print(f"{a.out}: {len(out)} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
