"""`specpilot weights ...`: pack a bf16 model into W12 and verify a pack against its source.

`register_cli(subparsers)` adds the `weights` command to the top-level parser. Also runnable on its own:
`python -m specpilot.weights.cli weights pack MODEL_DIR --out DIR`.
Both commands print, per tensor, its escapes, escape rate and bytes per weight, and the overall numbers.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from specpilot.cliutil import guarded, run_standalone
from specpilot.weights.format import W12Error
from specpilot.weights.pack import format_stats_table, pack_model, verify


def _pack(args: argparse.Namespace) -> int:
    manifest = pack_model(args.model_dir, args.out, group_rows=args.group_rows)
    print(format_stats_table([(e.name, e.shape, e.stats, "packed") for e in manifest.tensors]))
    print(f"wrote {args.out}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    report = verify(args.packed_dir, args.against)
    print(format_stats_table([(r.name, r.shape, r.stats, "exact" if r.ok else f"FAIL: {r.reason}")
                              for r in report.rows if r.stats is not None]))
    for r in report.rows:
        if r.stats is None:
            print(f"FAIL {r.name}: {r.reason}")
    for f in report.bad_files:
        print(f"FAIL shard {f}: missing or its sha256 differs from the manifest")
    failed = sum(not r.ok for r in report.rows) + len(report.bad_files)
    print("verify: every tensor decodes bit for bit to the source" if report.ok else f"verify: {failed} failure(s)")
    return 0 if report.ok else 1


_guarded = guarded("weights", "weights_command", (W12Error, OSError), exit_code=True)


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `weights pack` and `weights verify` to a top-level parser's subparsers; return the `weights` parser."""
    parser = subparsers.add_parser("weights", help="lossless W12 weights: pack a bf16 model, verify a pack")
    sub = parser.add_subparsers(dest="weights_command", required=True, metavar="COMMAND")
    p = sub.add_parser("pack", help="encode every tensor of a bf16 model directory into a W12 pack")
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--group-rows", type=int, default=None,
                   help="rows per exponent table (default: one table per tensor)")
    p.set_defaults(func=_guarded(_pack))
    p = sub.add_parser("verify", help="decode a W12 pack and compare every tensor bit for bit with the source")
    p.add_argument("packed_dir", type=Path, metavar="PACKED_DIR")
    p.add_argument("--against", type=Path, required=True, metavar="MODEL_DIR", help="the source model directory")
    p.set_defaults(func=_guarded(_verify))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
