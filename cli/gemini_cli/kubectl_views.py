"""What `kubectl gemini` shows, computed from API objects (camelCase dicts), with no I/O.

`status_report` and `plan_report` turn a GeminiJob, its worker pods, the cluster's nodes and
the job's events into JSON-ready reports; `render_status` and `render_plan` print them as
kubectl-style tables. The plan applies the pure planner (gemini.domain) to the placement the
operator published in status.placement and to the nodes' live zone and rack labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gemini.domain.placement import Machine, Placement, domain_spread
from gemini.domain.probability import recovery_probability
from gemini.domain.recovery import RecoveryPlan, ShardCopy, plan_recovery
from gemini_cli import CliError
from gemini_cli.output import format_table
from gemini_operator.core import naming
from gemini_operator.core.observed import RACK_LABEL, ZONE_LABEL
from gemini_operator.core.records import PlacementRecord

PERSIST_ANNOTATION = "gemini.io/persist-requested"
FINISHED_STATES = ("Succeeded", "Failed")
RECENT_EVENTS = 8


@dataclass(frozen=True)
class NodeInfo:
    name: str
    zone: str = ""
    rack: str = ""
    ready: str = ""  # the Ready condition's status ("True", "False", "Unknown"), "" if none
    unschedulable: bool = False

    @property
    def down(self) -> bool:
        """A node whose Ready condition says it is not (its pods' memory is unreachable)."""
        return self.ready in ("False", "Unknown")


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    pod: str
    node: str
    phase: str
    ready: bool
    restarts: int  # container restarts (in-place training restarts are not counted here)
    attempt: int
    deleting: bool


@dataclass(frozen=True)
class JobInfo:
    name: str
    namespace: str
    replicas: int
    num_nodes: int
    suspended: bool
    persistence: bool  # spec.persistence is set: S3 checkpoints exist or can be requested
    status: Mapping[str, Any]
    annotations: Mapping[str, str]

    @property
    def state(self) -> str:
        return str(self.status.get("state") or "Unknown")


@dataclass(frozen=True)
class FailureRequest:
    """The failure domains a `plan` asks about (any mix; each name as given by the user)."""

    nodes: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    racks: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.nodes or self.zones or self.racks)


# --- parsing API objects ----------------------------------------------------------------------


def job_info(obj: Mapping[str, Any]) -> JobInfo:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    return JobInfo(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        replicas=int((spec.get("checkpoint") or {}).get("replicas", 2)),
        num_nodes=int(spec.get("numNodes", 0)),
        suspended=bool(spec.get("suspend", False)),
        persistence=bool(spec.get("persistence")),
        status=obj.get("status") or {},
        annotations=dict(meta.get("annotations") or {}),
    )


def node_infos(nodes: Iterable[Mapping[str, Any]]) -> dict[str, NodeInfo]:
    out: dict[str, NodeInfo] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        conditions = (node.get("status") or {}).get("conditions") or ()
        ready = next((str(c.get("status")) for c in conditions if c.get("type") == "Ready"), "")
        name = str(meta.get("name", ""))
        out[name] = NodeInfo(
            name=name,
            zone=str(labels.get(ZONE_LABEL, "")),
            rack=str(labels.get(RACK_LABEL, "")),
            ready=ready,
            unschedulable=bool((node.get("spec") or {}).get("unschedulable", False)),
        )
    return out


def worker_infos(pods: Iterable[Mapping[str, Any]]) -> dict[int, WorkerInfo]:
    """The current worker of every rank: the newest restart attempt, a live pod before one
    that is being deleted."""
    best: dict[int, WorkerInfo] = {}
    for pod in pods:
        worker = _worker(pod)
        if worker is None:
            continue
        old = best.get(worker.rank)
        if old is None or (worker.attempt, not worker.deleting) > (old.attempt, not old.deleting):
            best[worker.rank] = worker
    return dict(sorted(best.items()))


def _worker(pod: Mapping[str, Any]) -> WorkerInfo | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        rank = int(labels[naming.LABEL_RANK])
        attempt = int(labels.get(naming.LABEL_RESTART_ATTEMPT, "0"))
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    containers = [*(status.get("initContainerStatuses") or ()),
                  *(status.get("containerStatuses") or ())]
    return WorkerInfo(
        rank=rank,
        pod=str(meta.get("name", "")),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        phase=str(status.get("phase") or "Pending"),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True"
                  for c in status.get("conditions") or ()),
        restarts=sum(int(c.get("restartCount") or 0) for c in containers),
        attempt=attempt,
        deleting=meta.get("deletionTimestamp") is not None,
    )


# --- status ---------------------------------------------------------------------------------


def status_report(
    job: JobInfo,
    workers: Mapping[int, WorkerInfo],
    nodes: Mapping[str, NodeInfo],
    events: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Everything `kubectl gemini status` shows, as one JSON-ready document."""
    status = job.status
    placement = status.get("placement")
    group_of = _group_of(placement)
    return {
        "job": job.name,
        "namespace": job.namespace,
        "state": job.state,
        "numNodes": job.num_nodes,
        "replicas": job.replicas,
        "workers": [_worker_row(w, nodes.get(w.node), group_of.get(w.rank)) for w in
                    workers.values()],
        "missingRanks": [r for r in range(job.num_nodes) if r not in workers],
        "placement": _placement_summary(placement, workers, nodes),
        "replicaCoverage": replica_coverage(status),
        "checkpoint": {
            "inMemoryStep": (status.get("checkpoint") or {}).get("inMemoryStep"),
            "persistedStep": (status.get("checkpoint") or {}).get("persistedStep"),
            "persistedTime": (status.get("checkpoint") or {}).get("persistedTime"),
            "persistRequested": job.annotations.get(PERSIST_ANNOTATION),
        },
        "recoveries": {
            "count": int(status.get("restarts") or 0),
            "last": _last_recovery(status.get("lastRecovery")),
            "events": [_event_row(e) for e in _recovery_events(events)],
        },
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason", "message", "lastTransitionTime")}
            for c in status.get("conditions") or ()
        ],
    }


def replica_coverage(status: Mapping[str, Any]) -> dict[str, Any]:
    """Shards with all m copies complete, when the operator publishes it
    (status.checkpoint.replicaCoverage as {complete, total} or a fraction); else unknown."""
    raw = (status.get("checkpoint") or {}).get("replicaCoverage")
    if isinstance(raw, Mapping) and raw.get("total"):
        complete, total = int(raw.get("complete") or 0), int(raw["total"])
        return {"known": True, "complete": complete, "total": total, "fraction": complete / total}
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return {"known": True, "fraction": float(raw)}
    return {"known": False, "note": "the operator does not publish replica coverage in status; "
            "see the gemini_replicas_complete metric"}


def _worker_row(worker: WorkerInfo, node: NodeInfo | None, group: int | None) -> dict[str, Any]:
    return {
        "rank": worker.rank,
        "pod": worker.pod,
        "node": worker.node,
        "zone": node.zone if node else "",
        "rack": node.rack if node else "",
        "nodeReady": node.ready if node else ("Missing" if worker.node else ""),
        "phase": "Terminating" if worker.deleting else worker.phase,
        "ready": worker.ready,
        "restarts": worker.restarts,
        "attempt": worker.attempt,
        "group": group,
    }


def _group_of(placement: Mapping[str, Any] | None) -> dict[int, int]:
    groups = (placement or {}).get("groups") or ()
    return {int(r): i for i, group in enumerate(groups) for r in group}


def _placement_summary(
    placement: Mapping[str, Any] | None,
    workers: Mapping[int, WorkerInfo],
    nodes: Mapping[str, NodeInfo],
) -> dict[str, Any] | None:
    if not placement:
        return None
    placed_on = {int(r): str(n) for r, n in (placement.get("nodes") or {}).items()}
    groups = []
    for index, group in enumerate(placement.get("groups") or ()):
        members = [int(r) for r in group]
        on = [_node_of(r, workers, placed_on) for r in members]
        groups.append({
            "group": index,
            "ranks": members,
            "nodes": on,
            "zones": sorted({nodes[n].zone for n in on if n in nodes and nodes[n].zone}),
            "racks": sorted({_domain_name(nodes[n], "rack") for n in on
                             if n in nodes and nodes[n].rack}),
        })
    moved = {str(r): {"placedOn": placed_on[r], "now": w.node} for r, w in workers.items()
             if r in placed_on and w.node and w.node != placed_on[r]}
    return {
        "strategy": placement.get("strategy"),
        "reason": placement.get("reason"),
        "replicas": placement.get("replicas"),
        "restartAttempt": placement.get("restartAttempt"),
        "groups": groups,
        "holders": {str(r): list(h) for r, h in (placement.get("holders") or {}).items()},
        "moved": moved,
    }


def _node_of(rank: int, workers: Mapping[int, WorkerInfo], placed_on: Mapping[int, str]) -> str:
    worker = workers.get(rank)
    if worker is not None and worker.node:
        return worker.node
    return placed_on.get(rank, "")


def _last_recovery(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not raw:
        return None
    keys = ("cause", "source", "failedRanks", "restoredStep", "stepsLost", "startTime",
            "completionTime", "durationMilliseconds")
    return {k: raw.get(k) for k in keys if raw.get(k) is not None}


def _recovery_events(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The newest events about recoveries and failures (the operator explains each in one)."""
    relevant = [e for e in events if str(e.get("type")) == "Warning"
                or "Recover" in str(e.get("reason", ""))]
    relevant.sort(key=_event_time)
    return relevant[-RECENT_EVENTS:]


def _event_time(event: Mapping[str, Any]) -> str:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        if event.get(key):
            return str(event[key])
    return str((event.get("metadata") or {}).get("creationTimestamp") or "")


def _event_row(event: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "time": _event_time(event),
        "type": event.get("type"),
        "reason": event.get("reason"),
        "count": event.get("count"),
        "message": event.get("message"),
    }


def render_status(report: Mapping[str, Any]) -> str:
    lines = [
        f"GeminiJob {report['namespace']}/{report['job']}: {report['state']}, "
        f"{report['numNodes']} ranks, m={report['replicas']} copies per shard",
        "",
        "WORKERS",
        format_table(
            ["RANK", "POD", "NODE", "ZONE", "RACK", "PHASE", "READY", "RESTARTS", "GROUP"],
            [[w["rank"], w["pod"], w["node"] or "<unscheduled>", w["zone"] or "-",
              w["rack"] or "-", w["phase"], _yes(w["ready"]), w["restarts"],
              "-" if w["group"] is None else w["group"]] for w in report["workers"]],
        ) if report["workers"] else "  no worker pods",
    ]
    if report["missingRanks"]:
        lines.append(f"  ranks without a pod: {_ranks(report['missingRanks'])}")
    lines += ["", *_render_placement(report["placement"])]
    lines += ["", *_render_checkpoint(report["checkpoint"], report["replicaCoverage"])]
    lines += ["", *_render_recoveries(report["recoveries"])]
    lines += ["", "CONDITIONS"]
    lines.append(format_table(
        ["TYPE", "STATUS", "REASON", "MESSAGE"],
        [[c["type"], c["status"], c["reason"] or "", c["message"] or ""]
         for c in report["conditions"]],
    ) if report["conditions"] else "  none yet (is the operator running?)")
    return "\n".join(lines)


def _render_placement(placement: Mapping[str, Any] | None) -> list[str]:
    if placement is None:
        return ["PLACEMENT", "  not computed yet: it is published once every worker is scheduled"]
    lines = [f"PLACEMENT  {placement['strategy']}: {placement['reason']}"]
    lines.append(format_table(
        ["GROUP", "RANKS", "NODES", "ZONES", "RACKS"],
        [[g["group"], _ranks(g["ranks"]), ", ".join(n or "?" for n in g["nodes"]),
          ", ".join(g["zones"]) or "-", ", ".join(g["racks"]) or "-"]
         for g in placement["groups"]],
    ))
    for rank, move in sorted(placement["moved"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"  rank {rank} moved from {move['placedOn']} to {move['now']} "
                     "since the placement was computed")
    return lines


def _render_checkpoint(checkpoint: Mapping[str, Any], coverage: Mapping[str, Any]) -> list[str]:
    memory, s3 = checkpoint["inMemoryStep"], checkpoint["persistedStep"]
    lines = ["CHECKPOINTS"]
    lines.append(f"  newest step in memory (all ranks): {_or_none(memory)}")
    persisted = _or_none(s3)
    if checkpoint["persistedTime"]:
        persisted += f" (committed {checkpoint['persistedTime']})"
    lines.append(f"  newest step in S3:                 {persisted}")
    if coverage["known"]:
        share = f"{coverage['fraction']:.0%}"
        if "total" in coverage:
            share = f"{coverage['complete']}/{coverage['total']} shards ({share})"
        lines.append(f"  replica coverage (all m copies):   {share}")
    else:
        lines.append("  replica coverage (all m copies):   unknown (not published in status)")
    if checkpoint["persistRequested"]:
        lines.append(f"  S3 checkpoint requested at:        {checkpoint['persistRequested']}")
    return lines


def _render_recoveries(recoveries: Mapping[str, Any]) -> list[str]:
    lines = [f"RECOVERIES  {recoveries['count']} so far"]
    last = recoveries["last"]
    if last:
        duration = last.get("durationMilliseconds")
        took = f"{duration / 1000:.1f} s" if duration is not None else "in progress"
        lines.append(
            f"  last: {last.get('cause', '?')} of ranks {_ranks(last.get('failedRanks') or [])}"
            f", restored step {_or_none(last.get('restoredStep'))} from "
            f"{last.get('source', '?')}, {_or_none(last.get('stepsLost'))} steps lost, "
            f"took {took} (started {last.get('startTime', '?')})"
        )
    for event in recoveries["events"]:
        lines.append(f"  {event['time']}  {event['type']:<7} {event['reason']}: "
                     f"{event['message']}")
    return lines


# --- plan -----------------------------------------------------------------------------------


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
    return {r: _node_of(r, workers, placement.nodes) for r in placement.layout.ranks}


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
                known = sorted({_domain_name(n, level) for n in nodes.values()} - {""})
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
               if getattr(n, level) and name in (getattr(n, level), _domain_name(n, level))]
    zones = sorted({n.zone for n in members})
    if level == "rack" and "/" not in name and len(zones) > 1:
        raise CliError(f"rack {name!r} exists in zones {', '.join(zones)}: name one as "
                       f"ZONE/RACK, e.g. --fail-rack {zones[0]}/{name}")
    return {n.name for n in members}


def _domain_name(node: NodeInfo, level: str) -> str:
    if level == "rack":
        return f"{node.zone}/{node.rack}" if node.rack else ""
    return str(getattr(node, level))


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
    lines.append(f"  ranks lost: {_ranks(scenario['failedRanks']) or 'none'}")
    if scenario["alreadyDown"]:
        lines.append(f"  already down: {_ranks(scenario['alreadyDown'])}")
    if not scenario["recoverable"]:
        lines.append(f"  UNRECOVERABLE: {plan['reason']}")
    else:
        where = "S3 IS NEEDED" if scenario["s3Needed"] else "from memory"
        lines.append(f"  {where}: {plan['reason']}")
        lines.append(format_table(
            ["RANK", "NODE", "ACTION", "SOURCE", "FROM", "REFETCH REPLICAS OF"],
            [[r["rank"], r["node"], r["action"], r["source"], r["from"] or "-",
              _ranks(r["refetch"]) or "-"] for r in scenario["ranks"]],
        ))
    if plan["replaceRanks"]:
        candidates = scenario["replacementCandidates"]
        lines.append("  replacement pods can go to: " + (", ".join(candidates) if candidates else
                     "no free Ready node; they stay Pending until one is added "
                     "(spec.failurePolicy.spareNodes keeps some free)"))
    lines += [f"  note: {note}" for note in scenario["notes"]]
    return lines


def _ranks(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def _or_none(value: object) -> str:
    return "none" if value is None else str(value)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
