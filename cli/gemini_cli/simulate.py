"""`gemini simulate`: effective training time of GEMINI, HighFreq and Strawman (paper's model).

The ratio for a strategy is steady - O * F / 1440, with F = instances * failure rate failures
per day and O its overhead in minutes per failure (GEMINI 9, HighFreq 26 with a steady share
of 480/560, Strawman 112). --measured-recovery-seconds adds a strategy "measured" built from
our own recovery time, checkpointing every iteration into memory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gemini.domain.goodput import (
    PAPER_FAILURES_PER_INSTANCE_DAY,
    PAPER_STRATEGIES,
    StrategyModel,
    effective_training_ratio,
    failures_per_day,
    model_from_measurements,
)
from gemini_cli import COMMANDS, CliError
from gemini_cli.output import add_output_flag, emit, format_table

PLOT_POINTS = 60


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help=COMMANDS["simulate"].help,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--instances", type=int, required=True, help="machines in the cluster")
    parser.add_argument(
        "--failures-per-instance-day",
        type=float,
        default=PAPER_FAILURES_PER_INSTANCE_DAY,
        help="failure rate per instance and day (default: 0.015, OPT-175B's logs)",
    )
    parser.add_argument(
        "--measured-recovery-seconds",
        type=float,
        help="our measured recovery time (detection to training again); adds 'measured'",
    )
    parser.add_argument(
        "--iteration-seconds",
        type=float,
        default=62.0,
        help="iteration time for the measured model (default: 62, GPT-2 100B in the paper)",
    )
    parser.add_argument(
        "--retrieve-seconds",
        type=float,
        default=3.0,
        help="checkpoint retrieval time for the measured model (default: 3)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the ratio across cluster sizes")
    add_output_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.instances < 1:
        raise CliError(f"--instances must be at least 1, got {args.instances}")
    if args.failures_per_instance_day < 0:
        raise CliError("--failures-per-instance-day must be non-negative")
    strategies = _strategies(args)
    report = build_report(args.instances, args.failures_per_instance_day, strategies)
    if args.plot:
        plot(args.plot, args.instances, args.failures_per_instance_day, strategies)
        report["plot"] = args.plot
    emit(args, report, render)
    return 0


def _strategies(args: argparse.Namespace) -> list[StrategyModel]:
    strategies = list(PAPER_STRATEGIES)
    if args.measured_recovery_seconds is not None:
        try:
            strategies.append(
                model_from_measurements(
                    "measured",
                    # In-memory checkpoints are spread over the iteration and taken every one.
                    checkpoint_seconds=args.iteration_seconds,
                    interval_seconds=args.iteration_seconds,
                    retrieve_seconds=args.retrieve_seconds,
                    recovery_seconds=args.measured_recovery_seconds,
                )
            )
        except ValueError as err:
            raise CliError(str(err)) from err
    return strategies


def build_report(
    instances: int, rate: float, strategies: Sequence[StrategyModel]
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "instances": instances,
        "failures_per_instance_day": rate,
        "failures_per_day": failures_per_day(instances, rate),
        "overhead_minutes_per_failure": {
            s.name: round(s.overhead_minutes_per_failure, 3) for s in strategies
        },
    }
    for strategy in strategies:
        report[strategy.name] = effective_training_ratio(strategy, instances, rate)
    return report


def render(report: dict[str, Any]) -> str:
    overheads = report["overhead_minutes_per_failure"]
    rows = [[name, f"{minutes:g}", f"{report[name]:.1%}"] for name, minutes in overheads.items()]
    header = (
        f"{report['instances']} instances, {report['failures_per_day']:g} failures/day "
        f"({report['failures_per_instance_day']:g} per instance-day)"
    )
    table = format_table(["STRATEGY", "OVERHEAD MIN/FAILURE", "EFFECTIVE TRAINING TIME"], rows)
    footer = f"\nplot written to {report['plot']}" if "plot" in report else ""
    return f"{header}\n{table}{footer}"


def plot(path: str, instances: int, rate: float, strategies: Sequence[StrategyModel]) -> None:
    """The ratio across cluster sizes up to max(2 x instances, 1000), like the paper's figure."""
    try:  # lazily: only this path needs it, and images leave the `tools` extra out
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise CliError(f"--plot needs matplotlib (pip install 'gemini-operator[tools]'): {err}"
                       ) from err

    top = max(2 * instances, 1000)
    sizes = sorted({max(1, top * i // PLOT_POINTS) for i in range(PLOT_POINTS + 1)} | {instances})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for strategy in strategies:
        ratios = [effective_training_ratio(strategy, n, rate) for n in sizes]
        ax.plot(sizes, ratios, label=strategy.name)
    ax.axvline(instances, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("instances")
    ax.set_ylabel("effective training time ratio")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{rate:g} failures per instance-day")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as err:
        raise CliError(f"cannot write the plot to {path}: {err}") from err
    finally:
        plt.close(fig)
