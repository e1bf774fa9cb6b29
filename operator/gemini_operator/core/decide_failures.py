"""The failures step of a decision: failures detected (pods, nodes, trainer exits, parked
launchers, hangs) and what the failure policy makes of them: recover (continue the recovery
under way, or start one; a recovery whose own epoch failed is a new failure), or fail the job.
Also the trainer exits it reads from the pods against the launch record.
"""

from __future__ import annotations

from collections.abc import Mapping

from gemini.domain.recovery import FailureKind, worst_failure
from gemini_operator.core import conditions as cond
from gemini_operator.core.actions import Recover
from gemini_operator.core.conditions import ConditionType
from gemini_operator.core.draft import Draft, current_pods, delete_active, finish
from gemini_operator.core.events import Event
from gemini_operator.core.failures import (
    RankFailure,
    apply_policy,
    describe,
    detect_failures,
    detect_hang,
    detect_parked,
    log_note,
)
from gemini_operator.core.observed import PodView
from gemini_operator.core.records import LaunchRecord
from gemini_operator.core.spec import JobSpec, RuleAction
from gemini_operator.core.types import Observed, ReconcileConfig


def judge_failures(
    observed: Observed, spec: JobSpec, config: ReconcileConfig, draft: Draft,
) -> bool:
    current = current_pods(observed, draft.status.restart_attempt)
    expected = frozenset(
        r for r in range(spec.num_nodes)
        if r not in observed.pending_creates and not (r in current and current[r].phase ==
                                                         "Succeeded")
    )
    exits = {**trainer_exits(current, draft.status.launch, draft.status.restart_attempt),
             **observed.process_exits}
    failures = detect_failures(current, observed.nodes, spec.num_nodes, expected, exits,
                               observed.parked)
    if not failures and not draft.is_true(ConditionType.RECOVERING):
        # Only when nothing else failed: a process parks when a peer's failure broke its
        # collective too, and that failure is the one to recover from.
        failures = detect_parked({r: e for r, e in observed.parked.items() if r not in exits},
                                 expected)
    if not failures:
        failures = detect_hang(observed.progress, observed.now,
                               spec.failure_policy.hang_timeout_seconds, sorted(expected))
    if draft.is_true(ConditionType.RECOVERING):
        cannot_start(observed, draft, current)
        if _failed_again(observed, spec, draft, current):
            return True
        # A recovery is under way (perhaps begun by a previous operator): continue it.
        draft.actions.append(Recover(_kind(failures), failures, spec))
        return True
    if not failures:
        if observed.progress is not None:
            # A hung job changes nothing that would call for a reconcile: come back when the
            # hang timeout runs out.
            since = (observed.now - observed.progress.since).total_seconds()
            left = spec.failure_policy.hang_timeout_seconds - since
            draft.requeue.append(max(1.0, left + 1.0))
        return False
    _decide_recovery(spec, draft, failures)
    return True


def _failed_again(observed: Observed, spec: JobSpec, draft: Draft,
                  current: Mapping[int, PodView]) -> bool:
    """Whether the recovery under way failed itself: a launcher took the recovery's epoch and
    its training process died again (a script that dies at start dies on every restart, and
    its launcher exits before the recovery sees it run). That is a new failure: it counts as
    a restart, or fails the job once maxRestarts are used up; the next recovery begins from
    the epoch that failed, and its trainer restarts count from now."""
    record = draft.status.recovery
    launch = draft.status.launch
    attempt = draft.status.restart_attempt
    exits = relaunch_exits(current, launch, attempt)
    if record is None or launch is None or not exits:
        return False
    failures = detect_failures(current, observed.nodes, spec.num_nodes, frozenset(exits), exits)
    if not failures:
        return False
    draft.status = draft.status.with_changes(recovery=None, launch=LaunchRecord(
        epoch=record.epoch, restart_attempt=attempt,
        trainer_restarts={r: p.trainer_restarts for r, p in current.items()},
        pod_uids={r: p.uid for r, p in current.items()}))
    _decide_recovery(spec, draft, failures)
    if draft.is_true(ConditionType.RECOVERING):  # unchanged, so no transition event: say it
        again = cond.find(draft.status.conditions, ConditionType.RECOVERING)
        message = again.message if again is not None else describe(failures)
        draft.events.append(Event.of_condition(
            cond.RECOVERY_NEEDED, f"the recovery's epoch {record.epoch} failed too: {message}"))
    return True


def cannot_start(observed: Observed, draft: Draft, current: Mapping[int, PodView]) -> bool:
    """Running False, naming a pod and why, when workers cannot start without help from
    outside (the scheduler cannot place them, a Secret or ConfigMap is missing, an image
    cannot be pulled): the reason would otherwise be only in the pods' events."""
    stuck = sorted((p.name, p.start_problem) for p in current.values()
                   if p.start_problem and not p.deleting)
    if not stuck:
        return False
    name, problem = stuck[0]
    more = f" (and {len(stuck) - 1} more pods)" if len(stuck) > 1 else ""
    draft.set(cond.WORKERS_CANNOT_START, pod=name, problem=problem, more=more)
    return True


def _decide_recovery(spec: JobSpec, draft: Draft, failures: tuple[RankFailure, ...]) -> None:
    decision = apply_policy(spec.failure_policy, failures)
    cause = describe(failures)
    if decision.action is RuleAction.FAIL_JOB:
        rule = decision.rule.name if decision.rule else ""
        draft.set(cond.FAILURE_POLICY_FAIL_JOB, cause=cause, rule=rule, log=log_note(failures))
        finish(draft)
        draft.actions.extend(delete_active(draft.observed, "the failure policy failed the job"))
        return
    if decision.counts and draft.status.restarts >= spec.failure_policy.max_restarts:
        draft.set(cond.MAX_RESTARTS_EXCEEDED, cause=cause, restarts=draft.status.restarts,
                  log=log_note(failures))
        finish(draft)
        draft.actions.extend(delete_active(draft.observed, "the job ran out of restarts"))
        return
    kind = _kind(failures)
    draft.set(cond.RECOVERY_NEEDED, cause=cause, intent=_intent(kind))
    if decision.counts:
        draft.status = draft.status.with_changes(restarts=draft.status.restarts + 1)
    draft.actions.append(Recover(kind, failures, spec))


def trainer_exits(
    pods: Mapping[int, PodView], launch: LaunchRecord | None, attempt: int,
) -> dict[int, int]:
    """Ranks whose trainer container restarted since the launchers were last told to run
    (the launcher exits when training fails), with the exit code it ended with."""
    if launch is None or launch.restart_attempt != attempt:
        return {}
    exits = {}
    for rank, pod in pods.items():
        same_pod = launch.pod_uids.get(rank) == pod.uid
        base = launch.trainer_restarts.get(rank, 0) if same_pod else 0
        if pod.trainer_restarts > base:
            code = pod.trainer_last_exit.exit_code if pod.trainer_last_exit else 1
            exits[rank] = code or 1
    return exits


def relaunch_exits(
    pods: Mapping[int, PodView], launch: LaunchRecord | None, attempt: int,
) -> dict[int, int]:
    """During a recovery: ranks whose trainer container restarted more often than the failed
    epoch explains, with the exit code it ended with. A launcher of the failed epoch ends at
    most once more (its process may die after the failure was seen), then holds until told
    the recovery's epoch; so a further restart is that epoch's process dying. A pod new since
    the launch (a replacement) has no failed epoch to end: any restart counts."""
    if launch is None or launch.restart_attempt != attempt:
        return {}
    exits = {}
    for rank, pod in pods.items():
        same_pod = launch.pod_uids.get(rank) == pod.uid
        allowed = launch.trainer_restarts.get(rank, 0) + 1 if same_pod else 0
        if pod.trainer_restarts > allowed:
            code = pod.trainer_last_exit.exit_code if pod.trainer_last_exit else 1
            exits[rank] = code or 1
    return exits


def _kind(failures: tuple[RankFailure, ...]) -> FailureKind:
    return worst_failure(f.kind for f in failures) or FailureKind.SOFTWARE


def _intent(kind: FailureKind) -> str:
    if kind is FailureKind.HARDWARE:
        return "replacing the lost ranks; the others restore from their own memory"
    return "restarting every training process in place from local memory"
