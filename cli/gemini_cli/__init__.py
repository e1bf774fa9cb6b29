"""The `gemini` command: one entry point, one module per subcommand group.

Each module listed in COMMANDS exposes `register(subparsers)`, which adds its subcommand(s)
and sets `func` (a callable taking the parsed args, returning an exit code).

Only the chosen command's module is imported: `gemini operator run`, `gemini sidecar` and
`gemini launch` run in images without the dev tools (`tools/`: the local cluster, the demo,
plotting), so building their parser must not import those (tests/unit/cli checks it).
Without a command, every command is listed by its name and help line alone.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType


class Command:
    """A subcommand group: its module (imported only when chosen), and its help line."""

    def __init__(self, module: str, help_text: str, tools: bool = False,
                 extra: str = "") -> None:
        # tools: a dev tool (the `tools` extra); extra: the optional dependencies it needs
        self.module, self.help, self.tools = module, help_text, tools
        self.extra = "tools" if tools else extra


COMMANDS: dict[str, Command] = {
    "checkpoint": Command("gemini_cli.checkpoint",
                          "copy a legacy S3 checkpoint into a GeminiJob's own directory",
                          extra="sidecar"),
    "demo": Command("gemini_cli.demo",
                    "train through failures on the local cluster and report the downtime", True),
    "fault": Command("gemini_cli.fault", "inject failures into the local cluster", True),
    "launch": Command("gemini_cli.launch",
                      "run and supervise the training process (restart it in place)"),
    "local": Command("gemini_cli.local",
                     "a local Kubernetes cluster whose pods run as processes", True),
    "migrate": Command("gemini_cli.migrate",
                       "rewrite GeminiJob manifests from v1alpha1 to v1beta1 (a pod template)"),
    "operator": Command("gemini_cli.operator", "the GeminiJob operator"),
    "plan": Command("gemini_cli.plan",
                    "show the replica placement and the recovery probability"),
    "sidecar": Command("gemini_cli.sidecar", "run the checkpoint sidecar of one worker pod",
                       extra="sidecar"),
    "simulate": Command("gemini_cli.simulate",
                        "effective training time of GEMINI vs. remote-storage checkpointing"),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: the chosen command fully, the others as their help line only.
    Without argv, every command fully (for tests and documentation checks)."""
    parser = argparse.ArgumentParser(
        prog="gemini",
        description="GEMINI training operator: in-memory checkpoints and fast recovery.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    chosen = _chosen(argv)
    for name, command in COMMANDS.items():
        if argv is None or name == chosen:
            _load(name, command).register(subparsers)
        else:
            subparsers.add_parser(name, help=command.help)
    return parser


def _chosen(argv: Sequence[str] | None) -> str | None:
    words = list(sys.argv[1:] if argv is None else argv)
    return next((w for w in words if not w.startswith("-")), None)


def _load(name: str, command: Command) -> ModuleType:
    try:
        return importlib.import_module(command.module)
    except ImportError as err:
        if not command.extra:
            raise
        what = "is a dev tool and needs" if command.tools else "needs"
        raise SystemExit(
            f"error: `gemini {name}` {what} the `{command.extra}` extra "
            f"(pip install 'gemini-operator[{command.extra}]'): {err}") from err


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    return run(build_parser(words).parse_args(words))


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
    except ModuleNotFoundError as err:  # a command's optional dependencies, imported lazily
        command = COMMANDS.get(getattr(args, "command", None) or "")
        if command is None or not command.extra:
            raise
        print(f"error: `gemini {args.command}` needs the `{command.extra}` extra (pip install "
              f"'gemini-operator[{command.extra}]'): {err}", file=sys.stderr)
        return 2


class CliError(Exception):
    """An error the user can act on; printed without a traceback."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


if __name__ == "__main__":
    sys.exit(main())
