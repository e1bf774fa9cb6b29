"""Shared `--output` handling: a readable table by default, JSON for scripts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any


def add_output_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="output format (default: table)",
    )


def emit(args: argparse.Namespace, data: Any, render_table: Callable[[Any], str]) -> None:
    """Print `data` as JSON when asked, else through `render_table`."""
    if getattr(args, "output", "table") == "json":
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        print(render_table(data))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, like kubectl's plain output."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def format_ranks(ranks: Sequence[int], limit: int = 16) -> str:
    """Rank numbers for a table cell, the first `limit` of them."""
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")
