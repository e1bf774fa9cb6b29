"""`gemini demo`: train on the local cluster through three failures and report what they cost."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gemini_cli import COMMANDS, CliError
from gemini_cli.output import add_output_flag, emit
from gemini_demo.plan import (
    DEFAULT_FAILURES,
    ENGINES,
    FAILURE_KINDS,
    MODEL_SIZES,
    PERSIST_INTERVAL_SECONDS,
    DemoConfig,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo", help=COMMANDS["demo"].help,
        description=(
            "Brings up the local cluster (workers, spare nodes, 2 zones, S3), installs the CRD, "
            "starts the operator, runs an uninterrupted reference, then trains a small GPT with "
            "DeepSpeed ZeRO-3 as a GeminiJob while injecting a trainer crash, a node loss and "
            "the loss of a whole placement group; ends with a report per failure (source, "
            "downtime, steps lost, losses equal to the reference) and tears everything down, "
            "also when stopped by SIGTERM or SIGINT (Ctrl-C; exit code 143 or 130)."),
    )
    parser.add_argument("--workers", type=int, default=4, help="training nodes (default 4)")
    parser.add_argument("--replicas", type=int, default=2,
                        help="in-memory copies of each shard, m (default 2; 1: a node loss "
                        "restores from S3)")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: enough for the failures)")
    parser.add_argument("--step-sleep", type=float, default=0.5,
                        help="seconds each step idles, so failures land mid-training "
                        "(default 0.5; the losses do not depend on it)")
    parser.add_argument("--failures", default=",".join(DEFAULT_FAILURES),
                        help=f"comma-separated, in order, from {','.join(FAILURE_KINDS)} "
                             f"(default {','.join(DEFAULT_FAILURES)})")
    parser.add_argument("--procs-per-node", type=int, default=1,
                        help="training processes per worker pod, numProcPerNode (default 1)")
    parser.add_argument("--engine", choices=ENGINES, default="deepspeed",
                        help="the example's training stack (default deepspeed: ZeRO-3; "
                        "zero1, zero2: "
                        "DeepSpeed ZeRO-1/2)")
    parser.add_argument("--warm-standby", action=argparse.BooleanOptionalAction, default=True,
                        help="launchers keep a pre-imported Python (torch, DeepSpeed) ready, "
                        "so a crashed process's replacement skips the imports (the default, "
                        "failurePolicy.warmStandby; about 0.45 GB more per worker); a trainer "
                        "crash then waits for the target's standby to be ready")
    parser.add_argument("--persist-interval", type=int, default=PERSIST_INTERVAL_SECONDS,
                        help="persistence.intervalSeconds: seconds from one S3 upload's end to "
                        f"the next's start (default {PERSIST_INTERVAL_SECONDS}; 1: back to back)")
    parser.add_argument("--kubelet", action="store_true",
                        help="real kubelet nodes (containerd, runc; root) running the images "
                        "built from the Dockerfile (sidecar, examples; built once, cached) "
                        "instead of node agents running this checkout")
    parser.add_argument("--with-monitoring", action="store_true",
                        help="also run Prometheus, configured by the Prometheus Operator from "
                        "the chart's monitors and alert rules (built once, cached); the report "
                        "says where it is")
    parser.add_argument("--keep", action="store_true",
                        help="leave the cluster, operator and job running afterwards")
    parser.add_argument("--reference-cache", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="take the uninterrupted reference's losses from an earlier run of "
                        "the same script, arguments, packages and CPU when one is cached "
                        "(under $GEMINI_CACHE/references; the default), instead of running it "
                        "again")
    parser.add_argument("--plot", type=Path, default=None, help="write the figure to this PNG")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the demo's cluster keeps its state (default: "
                        "$GEMINI_DEMO_DIR or ~/.gemini/demo)")
    add_output_flag(parser)
    parser.set_defaults(func=run)


def config_of(args: argparse.Namespace) -> DemoConfig:
    failures = tuple(f.strip() for f in args.failures.split(",") if f.strip())
    try:
        return DemoConfig(workers=args.workers, replicas=args.replicas,
                          model_size=args.model_size, steps=args.steps, failures=failures,
                          step_sleep=args.step_sleep, warm_standby=args.warm_standby,
                          procs_per_node=args.procs_per_node, engine=args.engine,
                          persist_interval=args.persist_interval, kubelet=args.kubelet,
                          monitoring=args.with_monitoring)
    except ValueError as err:
        raise CliError(str(err), exit_code=2) from err


def run(args: argparse.Namespace) -> int:
    from gemini_demo.interrupt import DemoInterrupted
    from gemini_demo.report import render_text
    from gemini_demo.session import DemoError, DemoOptions, run_demo
    from gemini_local.controlplane import ControlPlaneError
    from gemini_local.faults import FaultError
    from gemini_local.s3 import S3Error

    config = config_of(args)
    state_dir = args.state_dir or Path(
        os.environ.get("GEMINI_DEMO_DIR", Path.home() / ".gemini" / "demo"))
    # Progress goes to stderr when stdout carries JSON.
    progress = sys.stderr if args.output == "json" else sys.stdout
    options = DemoOptions(config=config, state_dir=Path(state_dir), keep=args.keep,
                          plot=args.plot, progress=progress,
                          reference_cache=args.reference_cache)
    try:
        report = run_demo(options)
    except (DemoError, ControlPlaneError, FaultError, S3Error) as err:
        raise CliError(f"the demo failed: {err}") from err
    except DemoInterrupted as stop:  # SIGTERM or SIGINT, once the teardown is done
        print(f"gemini demo: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code

    def text(data: Any) -> str:
        return render_text(data) + (f"\nfigure: {data['plot']}" if data.get("plot") else "")

    emit(args, report, text)
    ok = report["losses_match"] and all(r["downtime_seconds"] is not None
                                        for r in report["failures"])
    return 0 if ok else 1
