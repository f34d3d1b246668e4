"""`specpilot audit RUN [--store URI]`: re-hash a run's artifacts; exit 1 naming every bad one.

`register_cli(subparsers)` adds the command to the top-level parser; it sets `func`, which takes the parsed
arguments and returns the exit status (0 clean, 1 missing/corrupted artifacts, 2 the store is unusable).
Also runnable on its own: `python -m specpilot.artifacts.cli audit RUN`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from specpilot.cliutil import run_standalone
from specpilot.artifacts.audit import audit_run, format_audit
from specpilot.artifacts.factory import default_store_uri, store_from_uri
from specpilot.artifacts.manifest import run_prefix
from specpilot.artifacts.store import StoreError


def _audit(args: argparse.Namespace) -> int:
    try:
        store = store_from_uri(args.store)
        prefix = args.run if "/" in args.run else run_prefix(args.run)
        report = audit_run(store, prefix)
    except (StoreError, ValueError) as e:
        print(f"specpilot audit: error: {e}", file=sys.stderr)
        return 2
    print(format_audit(report))
    return 0 if report.ok else 1


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `audit` to a top-level parser's subparsers; return its parser."""
    p = subparsers.add_parser("audit", help="re-hash every artifact of a run; exit 1 if any is missing or corrupted")
    p.add_argument("run", metavar="RUN", help="run id (audits runs/RUN/), or a store prefix containing '/'")
    p.add_argument("--store", default=None,
                   help=f"artifact store: a path, file:///dir or s3://bucket/prefix?endpoint=URL "
                        f"(default $SPECPILOT_STORE, else {default_store_uri()})")
    p.set_defaults(func=_audit)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
