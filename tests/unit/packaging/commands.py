"""Whether an argv names a real command of this project: a [project.scripts] console script
and, for `gemini`, subcommands that its argparse tree really has."""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Sequence
from pathlib import Path

from gemini_cli import build_parser

ROOT = Path(__file__).resolve().parents[3]


def console_scripts() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["scripts"])


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def unknown_part(argv: Sequence[str]) -> str | None:
    """None when `argv` starts with a real command; else what is wrong with it."""
    if not argv:
        return "the command is empty"
    scripts = console_scripts()
    if argv[0] not in scripts:
        return f"{argv[0]!r} is not one of the project's console scripts {sorted(scripts)}"
    if argv[0] != "gemini":
        return None
    parser = build_parser()
    for word in argv[1:]:
        choices = _subcommands(parser)
        if not choices or word.startswith("-"):
            return None  # the rest are options or arguments of a leaf command
        if word not in choices:
            return f"`gemini` has no subcommand {word!r} here (known: {sorted(choices)})"
        parser = choices[word]
    if _subcommands(parser):
        return f"{' '.join(argv)!r} names a command group, not a command"
    return None
