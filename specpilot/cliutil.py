"""Shared piece of the subcommand modules: expected failures become one-line errors with exit code 2."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def guarded(group: str, command_attr: str, errors: tuple[type[BaseException], ...], exit_code: bool = False):
    """Wrap `action(args) -> printable` as a subcommand: print its result (exit 0), or print
    `specpilot GROUP COMMAND: error: ...` for the expected `errors` (exit 2). exit_code=True: the action prints for
    itself and returns the exit code (e.g. 1 when a check it ran failed)."""
    def wrap(action: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
        def run(args: argparse.Namespace) -> int:
            try:
                result = action(args)
            except errors as e:
                print(f"specpilot {group} {getattr(args, command_attr)}: error: {e}", file=sys.stderr)
                return 2
            if exit_code:
                return int(result)
            print(result)
            return 0
        return run
    return wrap


def run_standalone(register_cli: Callable[[argparse._SubParsersAction], Any], argv=None) -> int:
    """`python -m specpilot.<area>.cli ...`: one area's subcommands without the rest of the CLI (bare hosts)."""
    parser = argparse.ArgumentParser(prog="specpilot")
    register_cli(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
