"""Shared piece of the subcommand modules: expected failures become one-line errors with exit code 2."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def guarded(group: str, command_attr: str, errors: tuple[type[BaseException], ...]):
    """Wrap `action(args) -> printable` as a subcommand: print its result (exit 0), or print
    `specpilot GROUP COMMAND: error: ...` for the expected `errors` (exit 2)."""
    def wrap(action: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
        def run(args: argparse.Namespace) -> int:
            try:
                result = action(args)
            except errors as e:
                print(f"specpilot {group} {getattr(args, command_attr)}: error: {e}", file=sys.stderr)
                return 2
            print(result)
            return 0
        return run
    return wrap
