"""`gemini launch -- <command>`: the trainer container's entrypoint (gemini_trainer.launcher)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from gemini_cli import COMMANDS, CliError
from gemini_trainer.launch_config import LauncherConfig, LauncherConfigError
from gemini_trainer.launcher import Launcher


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "launch",
        help=COMMANDS["launch"].help,
        description="Runs the command, reports its exit, and restarts it in place when the "
        "operator asks (POST /restart), with a new restart epoch and restore instructions. "
        "Settings default to GEMINI_LAUNCHER_* and GEMINI_AUTH_TOKEN from the environment.",
    )
    p.add_argument(
        "--host",
        default=None,
        help="API address (default $GEMINI_LAUNCHER_HOST, $GEMINI_POD_IP or 127.0.0.1)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="API port (default $GEMINI_LAUNCHER_PORT or 7071; 0 picks one)",
    )
    p.add_argument(
        "--status-file",
        type=Path,
        default=None,
        help="JSON status written on every change ($GEMINI_LAUNCHER_STATUS_FILE)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=None,
        dest="grace_s",
        help="seconds between SIGTERM and SIGKILL when stopping the process",
    )
    p.add_argument(
        "--exit-on-failure",
        action="store_true",
        help="exit with the process's code when it fails instead of waiting for "
        "/restart (for runs without an operator)",
    )
    p.add_argument(
        "--insecure-local",
        action="store_true",
        help="allow no GEMINI_AUTH_TOKEN (or one under 16 characters) for a local run: the API "
        "then listens on a loopback address only, open to local processes "
        "($GEMINI_LAUNCHER_INSECURE_LOCAL=1)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after `--`")
    p.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("no training command: use `gemini launch -- python train.py ...`", 2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s")
    config = LauncherConfig.from_env(
        command,
        host=args.host,
        port=args.port,
        status_file=args.status_file,
        grace_s=args.grace_s,
        exit_on_failure=args.exit_on_failure or None,
        insecure_local=args.insecure_local or None,
    )
    try:
        launcher = Launcher(config)
    except LauncherConfigError as err:
        raise CliError(f"the launcher cannot start: {err}", 2) from err
    except OSError as err:
        raise CliError(f"cannot listen on {config.host}:{config.port}: {err}") from err
    return launcher.run()
