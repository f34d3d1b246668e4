"""The `specpilot` command: one subcommand per area, each registered by its own module."""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add subcommands, in help order. Each exposes register_cli(subparsers).
_CLI_MODULES = (
    "specpilot.stages.cli",
    "specpilot.bench.cli",
    "specpilot.testbed.cli",
    "specpilot.memory.cli",
    "specpilot.artifacts.cli",
    "specpilot.weights.cli",
    "specpilot.drafting.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpilot", description="Self-tuning lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _CLI_MODULES:
        importlib.import_module(name).register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # user-facing errors: one clear line, no traceback
        print(f"specpilot: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
