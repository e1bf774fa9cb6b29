"""Failure detection, classification and the failure policy: pure functions over views.

A rank has failed when its pod is gone, going away, or Failed (hardware for the planner: the
sidecar's memory went with it), when its node is not Ready (hardware), when the launcher
reports that the training process died on a live pod (software), or when the job made no
progress for the hang timeout (hang). Each failure carries the reason and exit code the
failure policy rules match on; the first matching rule decides, JobSet-style.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from gemini.control.launcher import OUT_OF_MEMORY
from gemini.domain.recovery import FailureKind
from gemini_operator.core.observed import NodeView, PodView
from gemini_operator.core.spec import FailurePolicy, FailureRule, RuleAction

LOG_TAIL_LINES, LOG_TAIL_CHARS = 10, 1500


class FailureReason(StrEnum):
    """The values of failurePolicy.rules[].onPodFailureReasons (the CRD's enum)."""

    ERROR = "Error"
    OOM_KILLED = "OOMKilled"
    EVICTED = "Evicted"
    PREEMPTED = "Preempted"
    NODE_LOST = "NodeLost"
    POD_DELETED = "PodDeleted"
    HANG = "Hang"


@dataclass(frozen=True)
class RankFailure:
    rank: int
    kind: FailureKind
    reason: FailureReason
    exit_code: int | None
    detail: str  # a lower-case phrase for messages: "the pod was evicted"
    log_tail: str = ""  # the last lines of the trainer's log, when the kubelet kept them


@dataclass(frozen=True)
class Progress:
    """The newest training step seen and when it was first seen (from heartbeats/inventory)."""

    step: int
    since: datetime


@dataclass(frozen=True)
class PolicyDecision:
    action: RuleAction
    rule: FailureRule | None  # None: no rule matched, the default (RestartJob) applies
    counts: bool  # whether the recovery counts against maxRestarts


_DISRUPTIONS = {
    "PreemptionByScheduler": (FailureReason.PREEMPTED, "the pod was preempted"),
    "EvictionByEvictionAPI": (FailureReason.EVICTED, "the pod was evicted"),
    "DeletionByTaintManager": (FailureReason.NODE_LOST, "the pod was evicted from a lost node"),
    "TerminationByKubelet": (FailureReason.EVICTED, "the kubelet terminated the pod"),
}


def detect_failures(
    pods: Mapping[int, PodView],
    nodes: Mapping[str, NodeView],
    num_nodes: int,
    expected: frozenset[int],
    process_exits: Mapping[int, int] | None = None,
    last_words: Mapping[int, str] | None = None,
) -> tuple[RankFailure, ...]:
    """Failed ranks among `expected` (the ranks that should have a live pod now);
    `last_words`: what a launcher that outlived its process said about it."""
    failures = []
    for rank in sorted(expected):
        if rank >= num_nodes:
            continue
        failure = _rank_failure(rank, pods.get(rank), nodes, (process_exits or {}).get(rank),
                                (last_words or {}).get(rank))
        if failure is not None:
            failures.append(failure)
    return tuple(failures)


def detect_parked(parked: Mapping[int, str], expected: frozenset[int]
                  ) -> tuple[RankFailure, ...]:
    """Ranks whose training raised and parked for an in-process restart (no process
    exited, so no container restart shows it), with the end of what they said."""
    return tuple(
        RankFailure(rank, FailureKind.SOFTWARE, FailureReason.ERROR, None,
                    "the training process failed (it waits for an in-process restart)",
                    log_tail(parked[rank]))
        for rank in sorted(parked) if rank in expected)


def detect_hang(
    progress: Progress | None, now: datetime, hang_timeout_seconds: int, ranks: Sequence[int]
) -> tuple[RankFailure, ...]:
    """Every rank is hung when the job made no progress for the timeout (training is
    synchronous: one stuck rank stalls them all, and we cannot tell which from outside)."""
    if progress is None or (now - progress.since).total_seconds() <= hang_timeout_seconds:
        return ()
    detail = f"no training progress past step {progress.step} for {hang_timeout_seconds} s"
    return tuple(RankFailure(r, FailureKind.HANG, FailureReason.HANG, None, detail) for r in ranks)


def _rank_failure(
    rank: int, pod: PodView | None, nodes: Mapping[str, NodeView], process_exit: int | None,
    words: str | None = None,
) -> RankFailure | None:
    hardware = FailureKind.HARDWARE
    if pod is None:
        return RankFailure(rank, hardware, FailureReason.POD_DELETED, None, "the pod was deleted")
    if pod.disruption_reason in _DISRUPTIONS:
        reason, detail = _DISRUPTIONS[pod.disruption_reason]
        return RankFailure(rank, hardware, reason, None, detail)
    if pod.phase == "Failed":
        return _failed_pod(rank, pod)
    if pod.deleting:
        return RankFailure(rank, hardware, FailureReason.POD_DELETED, None, "the pod was deleted")
    node = nodes.get(pod.node_name) if pod.node_name else None
    if pod.node_name and not _node_ready(node):
        detail = (f"node {pod.node_name} does not answer (its pods refuse connections while "
                  "the API still shows them running)" if node is not None and node.presumed_lost
                  else f"node {pod.node_name} is not ready")
        return RankFailure(rank, hardware, FailureReason.NODE_LOST, None, detail)
    if process_exit is not None and process_exit != 0:
        last = pod.trainer_last_exit
        if words and words.startswith(OUT_OF_MEMORY):
            first, _, rest = words.partition("\n")
            return RankFailure(rank, FailureKind.SOFTWARE, FailureReason.OOM_KILLED,
                               process_exit, first, log_tail(rest))
        return RankFailure(rank, FailureKind.SOFTWARE, FailureReason.ERROR, process_exit,
                           f"the training process exited with code {process_exit}",
                           log_tail(words or (last.message if last else "")))
    return None


def _failed_pod(rank: int, pod: PodView) -> RankFailure:
    hardware = FailureKind.HARDWARE
    if pod.status_reason == "Evicted":
        return RankFailure(rank, hardware, FailureReason.EVICTED, None, "the pod was evicted")
    code = pod.trainer_exit.exit_code if pod.trainer_exit else None
    if pod.trainer_exit is not None and pod.trainer_exit.reason == "OOMKilled":
        return RankFailure(rank, hardware, FailureReason.OOM_KILLED, code,
                           "the trainer ran out of memory")
    what = "the pod failed" if code is None else f"the trainer container exited with code {code}"
    tail = log_tail(pod.trainer_exit.message if pod.trainer_exit else "")
    return RankFailure(rank, hardware, FailureReason.ERROR, code, what, tail)


def _node_ready(node: NodeView | None) -> bool:
    return node is not None and node.ready


def matching_rule(rules: Sequence[FailureRule], failure: RankFailure) -> FailureRule | None:
    """The first rule whose conditions all hold: exit code listed (when the rule lists codes)
    and reason listed (when it lists reasons)."""
    for rule in rules:
        if rule.on_exit_codes and failure.exit_code not in rule.on_exit_codes:
            continue
        if rule.on_pod_failure_reasons and failure.reason.value not in rule.on_pod_failure_reasons:
            continue
        return rule
    return None


def apply_policy(policy: FailurePolicy, failures: Sequence[RankFailure]) -> PolicyDecision:
    """One decision for simultaneous failures: FailJob wins; the recovery is free only when
    every failure matched a RestartJobAndIgnoreMaxRestarts rule."""
    matched = [(f, matching_rule(policy.rules, f)) for f in failures]
    for _, rule in matched:
        if rule is not None and rule.action is RuleAction.FAIL_JOB:
            return PolicyDecision(RuleAction.FAIL_JOB, rule, counts=False)
    free = bool(matched) and all(
        r is not None and r.action is RuleAction.RESTART_JOB_AND_IGNORE_MAX_RESTARTS
        for _, r in matched
    )
    first_rule = next((r for _, r in matched if r is not None), None)
    if free:
        return PolicyDecision(RuleAction.RESTART_JOB_AND_IGNORE_MAX_RESTARTS, first_rule, False)
    return PolicyDecision(RuleAction.RESTART_JOB, first_rule, counts=True)


def log_tail(message: str, lines: int = LOG_TAIL_LINES, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `lines` non-blank lines of a termination message (the kubelet's tail of the
    log), at most `chars` characters of them: enough for a traceback's last frames."""
    kept = [line.rstrip() for line in message.splitlines() if line.strip()][-lines:]
    return "\n".join(kept)[-chars:]


def log_note(failures: Sequence[RankFailure]) -> str:
    """The last log lines of the first failure that has any, as the end of the message of a
    job that fails on them ("" when none has): a script that dies at start (an ImportError,
    a bad path) is explained in the job's status, not only in the pod's logs."""
    logged = next((f for f in failures if f.log_tail), None)
    if logged is None:
        return ""
    return f"; the last lines of rank {logged.rank}'s log:\n{logged.log_tail}"


def describe(failures: Sequence[RankFailure], limit: int = 3) -> str:
    """`rank 2: the pod was evicted; rank 5: node n3 is not ready (and 4 more)`."""
    parts = [f"rank {f.rank}: {f.detail}" for f in failures[:limit]]
    more = f" (and {len(failures) - limit} more)" if len(failures) > limit else ""
    return "; ".join(parts) + more
