"""`specpilot memory sql "SELECT ..." [--write] [--db PATH] [--run-dir DIR]` and `specpilot memory show [--db PATH]`.

`sql` opens the memory read-only unless --write is given, so a stray statement cannot change it (and the
statement check rejects anything but queries before DuckDB would). `--run-dir` adds views steps, requests
and kernels over that run's parquet traces. Every leaf command sets `func`, which takes the parsed
arguments and returns the exit status (0 ok, 2 on a user-facing error).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import duckdb

from specpilot.cliutil import guarded, run_standalone
from specpilot.memory.db import MEMORY_ENV, Memory, MemoryOpenError, ReadOnlyMemoryError, default_memory_path
from specpilot.memory.schema import SchemaVersionError

_ERRORS = (MemoryOpenError, ReadOnlyMemoryError, SchemaVersionError, ValueError, FileNotFoundError, duckdb.Error)


_guarded = guarded("memory", "memory_command", _ERRORS)


def _sql(args: argparse.Namespace) -> str:
    with Memory.open(args.db, read_only=not args.write) as memory:
        if args.run_dir is not None:
            attached = memory.attach_run_traces(args.run_dir)
            if not attached:
                raise FileNotFoundError(f"no steps/requests/kernels .parquet files under {args.run_dir}")
        return memory.sql(args.query, write=args.write).format()


def _show(args: argparse.Namespace) -> str:
    with Memory.open(args.db, read_only=True) as memory:
        return memory.show(recent_runs=args.runs).format()


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `memory` and its commands to a top-level parser's subparsers; return the `memory` parser."""
    parser = subparsers.add_parser("memory", help="mechanism memory: SQL access and a summary")
    sub = parser.add_subparsers(dest="memory_command", required=True, metavar="COMMAND")
    db_help = f"memory file (default ${MEMORY_ENV}, else {default_memory_path()})"

    p = sub.add_parser("sql", help="run SQL against the memory (read-only unless --write) and print a table")
    p.add_argument("query", help='e.g. "SELECT name, category FROM mechanisms"; several statements allowed')
    p.add_argument("--write", action="store_true", help="open read-write and allow statements that modify")
    p.add_argument("--db", type=Path, default=None, help=db_help)
    p.add_argument("--run-dir", type=Path, default=None,
                   help="a run directory whose **/steps.parquet, requests.parquet, kernels.parquet become views")
    p.set_defaults(func=_guarded(_sql))

    p = sub.add_parser("show", help="summarise the memory: table sizes, recent runs, mechanisms")
    p.add_argument("--db", type=Path, default=None, help=db_help)
    p.add_argument("--runs", type=int, default=10, help="how many recent runs to list")
    p.set_defaults(func=_guarded(_show))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
