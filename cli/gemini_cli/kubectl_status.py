"""`kubectl gemini status`, with no I/O: ``status_report`` turns a GeminiJob, its workers, the
nodes and the job's events into one JSON-ready report (workers, placement groups, replica
coverage, newest steps, recoveries, conditions); ``render_status`` prints it as kubectl-style
tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gemini_cli.kubectl_objects import (
    PERSIST_ANNOTATION,
    JobInfo,
    NodeInfo,
    WorkerInfo,
    domain_name,
    node_of,
)
from gemini_cli.output import format_ranks, format_table

RECENT_EVENTS = 8


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
        on = [node_of(r, workers, placed_on) for r in members]
        groups.append({
            "group": index,
            "ranks": members,
            "nodes": on,
            "zones": sorted({nodes[n].zone for n in on if n in nodes and nodes[n].zone}),
            "racks": sorted({domain_name(nodes[n], "rack") for n in on
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
        lines.append(f"  ranks without a pod: {format_ranks(report['missingRanks'])}")
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
        [[g["group"], format_ranks(g["ranks"]), ", ".join(n or "?" for n in g["nodes"]),
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
        failed = format_ranks(last.get("failedRanks") or [])
        lines.append(
            f"  last: {last.get('cause', '?')} of ranks {failed}"
            f", restored step {_or_none(last.get('restoredStep'))} from "
            f"{last.get('source', '?')}, {_or_none(last.get('stepsLost'))} steps lost, "
            f"took {took} (started {last.get('startTime', '?')})"
        )
    for event in recoveries["events"]:
        lines.append(f"  {event['time']}  {event['type']:<7} {event['reason']}: "
                     f"{event['message']}")
    return lines


def _or_none(value: object) -> str:
    return "none" if value is None else str(value)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
