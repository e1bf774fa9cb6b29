"""`python -m gemini_local.nodeagent --config <agent.json>`: run one node agent."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemini_local.nodeagent.agent import main


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gemini_local.nodeagent",
        description="Run one local Kubernetes node whose pods are local processes.")
    parser.add_argument("--config", type=Path, required=True,
                        help="agent.json written by gemini_local.nodes.start_node_agent")
    return main(parser.parse_args(argv).config)


if __name__ == "__main__":
    sys.exit(cli())
