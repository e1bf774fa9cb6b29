"""`gemini sidecar`: run the checkpoint sidecar of one worker (configured by GEMINI_* env)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from gemini_cli import COMMANDS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sidecar",
        help=COMMANDS["sidecar"].help,
        description=(
            "Holds this rank's shard and its peers' replicas in memory, replicates, serves "
            "fetches, persists to S3. Configured by GEMINI_JOB, GEMINI_RANK, GEMINI_WORLD_SIZE, "
            "GEMINI_AUTH_TOKEN, GEMINI_MEMORY_BUDGET_BYTES, GEMINI_PEERS, GEMINI_HOLD_RANKS, "
            "GEMINI_SEND_TO, GEMINI_POD_IP, GEMINI_SIDECAR_PORT, GEMINI_SHM_DIR, "
            "GEMINI_TRAFFIC_MODE and GEMINI_S3_* (see gemini_sidecar.config)."
        ),
    )
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gemini_cli import CliError
    from gemini_sidecar.app import serve_forever
    from gemini_sidecar.config import ConfigError, from_env

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = from_env()
    except ConfigError as err:
        raise CliError(f"bad sidecar configuration: {err}", exit_code=2) from err
    try:
        asyncio.run(serve_forever(cfg))
    except OSError as err:
        raise CliError(f"sidecar could not serve on {cfg.bind_host}: {err}; check GEMINI_POD_IP "
                       "and GEMINI_SIDECAR_PORT") from err
    return 0
