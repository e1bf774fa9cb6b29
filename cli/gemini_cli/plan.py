"""`gemini plan`: the replica placement for a cluster and how likely memory recovery is.

Without topology it shows GEMINI's mixed placement and the exact probability that K random
machine failures are recoverable from CPU memory. With --zones/--racks it builds a synthetic
topology (ranks fill racks in order, racks fill zones in order, as a scheduler packing pods
would), uses the failure-domain-aware placement, and compares it with the mixed placement
under whole-zone and whole-rack failures (Monte Carlo with a 95% interval).
"""

from __future__ import annotations

import argparse
from typing import Any

from gemini.domain.placement import (
    Machine,
    Placement,
    PlacementError,
    domain_aware_placement,
    domain_spread,
    mixed_placement,
)
from gemini.domain.probability import (
    group_closed_form,
    monte_carlo_domain_failures,
    recovery_probability,
)
from gemini_cli import COMMANDS, CliError
from gemini_cli.output import add_output_flag, emit, format_table

TABLE_GROUPS = 20


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help=COMMANDS["plan"].help,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, required=True, help="machines (ranks), N")
    parser.add_argument("--replicas", type=int, required=True, help="copies per shard, m (1-4)")
    parser.add_argument(
        "--failures", type=int, help="simultaneous random machine failures, K (default: m)"
    )
    parser.add_argument("--zones", type=int, help="zones in the synthetic topology")
    parser.add_argument("--racks", type=int, help="racks in the synthetic topology")
    parser.add_argument(
        "--trials", type=int, default=2000, help="Monte Carlo trials per domain failure scenario"
    )
    parser.add_argument("--seed", type=int, default=0, help="Monte Carlo seed (default: 0)")
    add_output_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failures = args.replicas if args.failures is None else args.failures
    try:
        report = build_report(args.nodes, args.replicas, failures, args.zones, args.racks, args)
    except PlacementError as err:
        raise CliError(str(err)) from err
    emit(args, report, render)
    return 0


def build_report(
    nodes: int,
    replicas: int,
    failures: int,
    zones: int | None,
    racks: int | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    mixed = mixed_placement(nodes, replicas)
    if not 0 <= failures <= nodes:
        raise CliError(f"--failures must be between 0 and --nodes ({nodes}), got {failures}")
    if zones is None and racks is None:
        return _placement_report(mixed, failures)
    machines = synthetic_topology(nodes, zones or 1, racks or zones or 1)
    aware = domain_aware_placement(machines, replicas)
    report = _placement_report(aware, failures)
    report["mixed_recovery_probability"] = float(recovery_probability(mixed, failures))
    report["domains"] = _domain_report(aware, mixed, machines, args.trials, args.seed)
    return report


def synthetic_topology(nodes: int, zones: int, racks: int) -> list[Machine]:
    """Rank i on node i, in rack floor(i R / N); rack j in zone floor(j Z / R)."""
    if not 1 <= zones <= racks <= nodes:
        raise CliError(
            f"need 1 <= zones <= racks <= nodes, got zones={zones}, racks={racks}, nodes={nodes}"
        )
    machines = []
    for rank in range(nodes):
        rack = rank * racks // nodes
        zone = rack * zones // racks
        machines.append(Machine(rank, f"node-{rank}", f"zone-{zone}", f"rack-{rack}"))
    return machines


def _placement_report(placement: Placement, failures: int) -> dict[str, Any]:
    exact = recovery_probability(placement, failures)
    report: dict[str, Any] = {
        "nodes": placement.num_machines,
        "replicas": placement.replicas,
        "failures": failures,
        "strategy": placement.strategy,
        "reason": placement.reason,
        "groups": [list(g) for g in placement.groups],
        "sends": {str(r): list(placement.sends_to(r)) for r in placement.ranks},
        "recovery_probability": float(exact),
        "recovery_probability_exact": f"{exact.numerator}/{exact.denominator}",
    }
    if placement.num_machines % placement.replicas == 0:
        bound = group_closed_form(placement.num_machines, placement.replicas, failures)
        report["paper_closed_form"] = float(bound)
    return report


def _domain_report(
    aware: Placement, mixed: Placement, machines: list[Machine], trials: int, seed: int
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "zones": len({m.zone for m in machines}),
        "racks": len({m.rack for m in machines}),
        "spread": {
            "domain_aware": domain_spread(aware, machines),
            "mixed": domain_spread(mixed, machines),
        },
    }
    for level in ("zone", "rack"):
        report[f"{level}_failure"] = {
            name: monte_carlo_domain_failures(
                placement, machines, level=level, trials=trials, seed=seed
            ).to_dict()
            for name, placement in (("domain_aware", aware), ("mixed", mixed))
        }
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        f"placement: {report['strategy']} (N={report['nodes']}, m={report['replicas']})",
        f"  {report['reason']}",
        f"recovery probability, {report['failures']} random failures: "
        f"{report['recovery_probability']:.4%}",
    ]
    if "paper_closed_form" in report:
        lines.append(f"  paper's closed form: {report['paper_closed_form']:.4%}")
    if "mixed_recovery_probability" in report:
        lines.append(f"  mixed placement: {report['mixed_recovery_probability']:.4%}")
    if "domains" in report:
        lines.extend(_render_domains(report["domains"]))
    lines.append("")
    lines.append(_render_groups(report))
    return "\n".join(lines)


def _render_domains(domains: dict[str, Any]) -> list[str]:
    rows = []
    for level in ("zone", "rack"):
        for name in ("domain_aware", "mixed"):
            est = domains[f"{level}_failure"][name]
            spread = domains["spread"][name][level]
            rows.append(
                [
                    f"one {level} lost",
                    name.replace("_", "-"),
                    f"{est['probability']:.2%}",
                    f"[{est['low']:.2%}, {est['high']:.2%}]",
                    spread,
                ]
            )
    headers = ["SCENARIO", "PLACEMENT", "RECOVERABLE", "95% INTERVAL", "MAX HOLDERS PER DOMAIN"]
    return ["", format_table(headers, rows)]


def _render_groups(report: dict[str, Any]) -> str:
    groups = report["groups"]
    rows = [
        [i, " ".join(str(r) for r in group), _sends_summary(report["sends"], group)]
        for i, group in enumerate(groups[:TABLE_GROUPS])
    ]
    table = format_table(["GROUP", "MEMBERS", "SENDS (rank->peers)"], rows)
    if len(groups) > TABLE_GROUPS:
        table += f"\n... {len(groups) - TABLE_GROUPS} more groups (--output json shows all)"
    return table


def _sends_summary(sends: dict[str, list[int]], group: list[int]) -> str:
    return ", ".join(f"{r}->{'/'.join(str(p) for p in sends[str(r)]) or '-'}" for r in group)
