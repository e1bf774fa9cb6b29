"""The `gemini` command: one entry point, one module per subcommand group.

Each module listed in COMMAND_MODULES exposes `register(subparsers)`, which adds its
subcommand(s) and sets `func` (a callable taking the parsed args, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES: list[str] = [
    "gemini.cli.demo",
    "gemini.cli.fault",
    "gemini.cli.launch",
    "gemini.cli.local",
    "gemini.cli.operator",
    "gemini.cli.plan",
    "gemini.cli.sidecar",
    "gemini.cli.simulate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gemini",
        description="GEMINI training operator: in-memory checkpoints and fast recovery.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; user errors, ^C and a closed pipe become exit codes."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


class CliError(Exception):
    """An error the user can act on; printed without a traceback."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


if __name__ == "__main__":
    sys.exit(main())
