"""`kubectl gemini plan`, with no I/O: ``plan_report`` applies the pure planner (gemini.domain)
to the placement the operator published in status.placement and to the nodes' live zone and
rack labels: the recovery probability for random node failures, whether any one zone, rack or
node may fail, and the recovery plan if the requested domains failed now (``FailureRequest``);
``render_plan`` prints it as kubectl-style tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gemini.domain.placement import Machine, Placement, domain_spread
from gemini.domain.probability import recovery_probability
from gemini.domain.recovery import RecoveryPlan, ShardCopy, plan_recovery
from gemini_cli import CliError
from gemini_cli.kubectl_objects import (
    FINISHED_STATES,
    JobInfo,
    NodeInfo,
    WorkerInfo,
    domain_name,
    node_of,
)
from gemini_cli.output import format_ranks, format_table
from gemini_operator.core.records import PlacementRecord


@dataclass(frozen=True)
class FailureRequest:
    """The failure domains a `plan` asks about (any mix; each name as given by the user)."""

    nodes: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    racks: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.nodes or self.zones or self.racks)


def job_placement(job: JobInfo) -> PlacementRecord:
    """The placement the job runs under (status.placement), or an error saying why not."""
    raw = job.status.get("placement")
    if job.suspended:
        raise CliError(f"geminijob {job.name} is suspended: no worker holds a checkpoint in "
                       "memory; on resume it restores from memory or S3")
    if job.state in FINISHED_STATES:
        raise CliError(f"geminijob {job.name} has finished ({job.state}); nothing to plan")
    if not raw:
        raise CliError(
            f"geminijob {job.name} has no placement yet: the operator publishes status.placement "
            "once every worker pod is scheduled (check `kubectl gemini status`)")
    try:
        return PlacementRecord.from_json(raw)
    except ValueError as err:  # PlacementError among them
        raise CliError(f"geminijob {job.name} has an unreadable status.placement: {err}") from err


def rank_nodes(placement: PlacementRecord, workers: Mapping[int, WorkerInfo]) -> dict[int, str]:
    """Where each rank runs now: its current pod's node, else where the placement put it."""
    return {r: node_of(r, workers, placement.nodes) for r in placement.layout.ranks}


def plan_report(
    job: JobInfo,
    workers: Mapping[int, WorkerInfo],
    nodes: Mapping[str, NodeInfo],
    request: FailureRequest,
    failures: int | None = None,
) -> dict[str, Any]:
    """What would happen if the requested domains failed now, and how likely random node
    failures are to be recoverable from memory under the job's actual placement."""
    record = job_placement(job)
    placement, on = record.layout, rank_nodes(record, workers)
    machines = [Machine(r, on[r], _label(nodes, on[r], "zone"), _label(nodes, on[r], "rack"))
                for r in placement.ranks]
    report: dict[str, Any] = {
        "job": job.name,
        "namespace": job.namespace,
        "ranks": placement.num_machines,
        "replicas": placement.replicas,
        "strategy": placement.strategy,
        "randomFailures": random_failure_table(placement, failures),
        "domainFailures": domain_resilience(placement, machines),
    }
    if request.empty:
        return report
    report["scenario"] = scenario(job, placement, on, workers, nodes, request)
    return report


def random_failure_table(placement: Placement, failures: int | None) -> list[dict[str, Any]]:
    """Exact recovery probability from memory for k = 1..m+1 random node failures (and the
    k asked for), over the job's actual holder sets."""
    n, m = placement.num_machines, placement.replicas
    ks = set(range(1, min(n, m + 1) + 1))
    if failures is not None:
        if not 1 <= failures <= n:
            raise CliError(f"--failures must be between 1 and the job's {n} ranks, got {failures}")
        ks.add(failures)
    rows = []
    for k in sorted(ks):
        p = recovery_probability(placement, k)
        rows.append({"failures": k, "probability": float(p),
                     "exact": f"{p.numerator}/{p.denominator}"})
    return rows


def domain_resilience(placement: Placement, machines: Sequence[Machine]) -> dict[str, Any]:
    """Per level: whether memory survives the loss of any one domain (no shard has all m
    holders in one zone, rack or node), from the nodes' live labels."""
    spread = domain_spread(placement, machines)
    out: dict[str, Any] = {}
    for level in ("zone", "rack", "node"):
        labelled = level == "node" or any(getattr(m, level) for m in machines)
        out[level] = {
            "labelled": labelled,
            "mostHoldersInOne": spread[level],
            "survivesAnyOne": labelled and spread[level] < placement.replicas,
        }
    return out


def scenario(
    job: JobInfo,
    placement: Placement,
    on: Mapping[int, str],
    workers: Mapping[int, WorkerInfo],
    nodes: Mapping[str, NodeInfo],
    request: FailureRequest,
) -> dict[str, Any]:
    """The recovery plan if the requested nodes, zones and racks failed now. Ranks that are
    already down (pod gone, node missing or not Ready) count as lost too."""
    failed_nodes, notes = resolve_failures(request, on, nodes, job.name)
    hit = {r for r, n in on.items() if n in failed_nodes}
    already = {r for r in placement.ranks if r not in hit and _down(r, on, workers, nodes)}
    lost = hit | already
    step = (job.status.get("checkpoint") or {}).get("inMemoryStep")
    persisted = (job.status.get("checkpoint") or {}).get("persistedStep")
    plan = plan_recovery(placement.replicas, placement, lost, lost,
                         assumed_inventory(placement, step), [] if persisted is None else
                         [int(persisted)])
    if step is None:
        notes.append("no step is complete in memory yet (status.checkpoint.inMemoryStep)")
    else:
        notes.append(f"assumes every holder has step {step} complete in memory, as "
                     "status.checkpoint.inMemoryStep reports")
    return {
        "request": describe_request(request),
        "failedNodes": sorted(failed_nodes),
        "failedRanks": sorted(hit),
        "alreadyDown": sorted(already),
        "plan": plan.to_dict(),
        "ranks": _plan_rows(plan, placement, on),
        "s3Needed": plan.mode == "s3",
        "recoverable": plan.recoverable,
        "replacementCandidates": sorted(
            n.name for n in nodes.values()
            if n.ready == "True" and not n.unschedulable and n.name not in failed_nodes
            and n.name not in set(on.values())),
        "notes": notes,
    }


def resolve_failures(
    request: FailureRequest, on: Mapping[int, str], nodes: Mapping[str, NodeInfo], job: str
) -> tuple[set[str], list[str]]:
    """The node names the request fails, and notes about names that hit no worker. Names that
    match nothing in the cluster are errors."""
    job_nodes = set(on.values())
    failed: set[str] = set()
    notes: list[str] = []
    for name in request.nodes:
        if name not in nodes and name not in job_nodes:
            raise CliError(f"unknown node {name!r}: not in the cluster and not in the job's "
                           f"placement; the job runs on {', '.join(sorted(job_nodes))}")
        failed.add(name)
        if name not in job_nodes:
            notes.append(f"node {name} runs no worker of {job}")
    for level, names in (("zone", request.zones), ("rack", request.racks)):
        for name in names:
            members = _domain_members(nodes, level, name)
            if not members:
                known = sorted({domain_name(n, level) for n in nodes.values()} - {""})
                raise CliError(f"unknown {level} {name!r}: no node carries it; the cluster's "
                               f"{level}s are {', '.join(known) or 'unlabelled'}")
            failed |= members
            if not members & job_nodes:
                notes.append(f"{level} {name} runs no worker of {job}")
    return failed, notes


def _domain_members(nodes: Mapping[str, NodeInfo], level: str, name: str) -> set[str]:
    """Nodes of one zone or rack. Rack names are unique only within a zone (as placement
    treats them), so a bare rack name found in several zones must be given as ZONE/RACK."""
    members = [n for n in nodes.values()
               if getattr(n, level) and name in (getattr(n, level), domain_name(n, level))]
    zones = sorted({n.zone for n in members})
    if level == "rack" and "/" not in name and len(zones) > 1:
        raise CliError(f"rack {name!r} exists in zones {', '.join(zones)}: name one as "
                       f"ZONE/RACK, e.g. --fail-rack {zones[0]}/{name}")
    return {n.name for n in members}


def describe_request(request: FailureRequest) -> str:
    parts = [f"{level} {name}" for level, names in
             (("node", request.nodes), ("zone", request.zones), ("rack", request.racks))
             for name in names]
    return ", ".join(parts)


def assumed_inventory(placement: Placement, step: int | None) -> list[ShardCopy]:
    """What the sidecars hold if every holder has `step` complete (what status reports)."""
    if step is None:
        return []
    return [ShardCopy(rank=r, version=int(step), holder=h, complete=True, checksum="")
            for r, holders in placement.holders.items() for h in holders]


def _down(rank: int, on: Mapping[int, str], workers: Mapping[int, WorkerInfo],
          nodes: Mapping[str, NodeInfo]) -> bool:
    worker = workers.get(rank)
    if worker is None or worker.deleting:
        return True
    node = nodes.get(on[rank])
    return node is None or node.down


def _plan_rows(plan: RecoveryPlan, placement: Placement, on: Mapping[int, str]
               ) -> list[dict[str, Any]]:
    rows = []
    replaced = set(plan.replace_ranks)
    for rank in sorted(placement.ranks):
        source = plan.sources.get(rank)
        holder = source.holder if source is not None else None
        rows.append({
            "rank": rank,
            "node": on[rank],
            "action": "replace" if rank in replaced else "restart in place",
            "source": source.kind if source is not None else "none",
            "from": "" if source is None or source.kind != "peer" or holder is None
            else f"rank {holder} on {on.get(holder, '?')}",
            "refetch": list(plan.refetch.get(rank, ())),
        })
    return rows


def _label(nodes: Mapping[str, NodeInfo], name: str, level: str) -> str:
    node = nodes.get(name)
    return str(getattr(node, level)) if node is not None else ""


def render_plan(report: Mapping[str, Any]) -> str:
    lines = [f"GeminiJob {report['namespace']}/{report['job']}: {report['ranks']} ranks, "
             f"m={report['replicas']}, {report['strategy']} placement", "",
             "RANDOM NODE FAILURES (exact, over the job's placement)"]
    lines.append(format_table(
        ["FAILED NODES", "RECOVERABLE FROM MEMORY"],
        [[r["failures"], f"{r['probability']:.2%} ({r['exact']})"]
         for r in report["randomFailures"]],
    ))
    lines += ["", "ONE WHOLE DOMAIN FAILING"]
    for level, row in report["domainFailures"].items():
        if not row["labelled"]:
            lines.append(f"  any one {level}: unknown (nodes have no {level} label)")
            continue
        verdict = "recoverable from memory" if row["survivesAnyOne"] else "may need S3"
        lines.append(f"  any one {level}: {verdict} (at most {row['mostHoldersInOne']} of a "
                     f"shard's {report['replicas']} copies share a {level})")
    if "scenario" in report:
        lines += ["", *_render_scenario(report["scenario"])]
    return "\n".join(lines)


def _render_scenario(scenario: Mapping[str, Any]) -> list[str]:
    plan = scenario["plan"]
    lines = [f"IF {scenario['request']} FAILED NOW "
             f"(nodes {', '.join(scenario['failedNodes'])})"]
    lines.append(f"  ranks lost: {format_ranks(scenario['failedRanks']) or 'none'}")
    if scenario["alreadyDown"]:
        lines.append(f"  already down: {format_ranks(scenario['alreadyDown'])}")
    if not scenario["recoverable"]:
        lines.append(f"  UNRECOVERABLE: {plan['reason']}")
    else:
        where = "S3 IS NEEDED" if scenario["s3Needed"] else "from memory"
        lines.append(f"  {where}: {plan['reason']}")
        lines.append(format_table(
            ["RANK", "NODE", "ACTION", "SOURCE", "FROM", "REFETCH REPLICAS OF"],
            [[r["rank"], r["node"], r["action"], r["source"], r["from"] or "-",
              format_ranks(r["refetch"]) or "-"] for r in scenario["ranks"]],
        ))
    if plan["replaceRanks"]:
        candidates = scenario["replacementCandidates"]
        lines.append("  replacement pods can go to: " + (", ".join(candidates) if candidates else
                     "no free Ready node; they stay Pending until one is added "
                     "(spec.failurePolicy.spareNodes keeps some free)"))
    lines += [f"  note: {note}" for note in scenario["notes"]]
    return lines
