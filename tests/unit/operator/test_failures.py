"""Failure detection and classification, and failure-policy rules, one sentence per case."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gemini.domain.recovery import FailureKind
from gemini_operator.core.failures import (
    FailureReason,
    Progress,
    RankFailure,
    apply_policy,
    detect_failures,
    detect_hang,
    matching_rule,
)
from gemini_operator.core.observed import ContainerExit, NodeView, PodView, node_view, pod_view
from gemini_operator.core.spec import FailurePolicy, FailureRule, RuleAction

NODES = {"n0": NodeView("n0", True), "n1": NodeView("n1", False)}


def _pod(**kw):
    base = {"name": "j-worker-0", "rank": 0, "attempt": 0, "uid": "u", "phase": "Running",
            "node_name": "n0", "ready": True}
    return PodView(**{**base, **kw})


CASES = [
    pytest.param(None, None, FailureKind.HARDWARE, FailureReason.POD_DELETED, None,
                 id="a missing pod is a deleted pod and loses its memory"),
    pytest.param(_pod(deleting=True), None, FailureKind.HARDWARE, FailureReason.POD_DELETED, None,
                 id="a pod being deleted is lost"),
    pytest.param(_pod(phase="Failed", trainer_exit=ContainerExit(3, "Error")), None,
                 FailureKind.HARDWARE, FailureReason.ERROR, 3,
                 id="a failed pod reports its trainer exit code"),
    pytest.param(_pod(phase="Failed", trainer_exit=ContainerExit(137, "OOMKilled")), None,
                 FailureKind.HARDWARE, FailureReason.OOM_KILLED, 137,
                 id="an out-of-memory kill is told apart"),
    pytest.param(_pod(phase="Failed", status_reason="Evicted"), None,
                 FailureKind.HARDWARE, FailureReason.EVICTED, None, id="an evicted pod"),
    pytest.param(_pod(disruption_reason="PreemptionByScheduler", deleting=True), None,
                 FailureKind.HARDWARE, FailureReason.PREEMPTED, None,
                 id="a preempted pod is preempted, not merely deleted"),
    pytest.param(_pod(node_name="n1"), None, FailureKind.HARDWARE, FailureReason.NODE_LOST, None,
                 id="a pod on a not-ready node is lost with its node"),
    pytest.param(_pod(node_name="gone"), None, FailureKind.HARDWARE, FailureReason.NODE_LOST,
                 None, id="a pod on a deleted node is lost with its node"),
    pytest.param(_pod(), 1, FailureKind.SOFTWARE, FailureReason.ERROR, 1,
                 id="a training process that died on a live pod is a software failure"),
]


@pytest.mark.parametrize(("pod", "process_exit", "kind", "reason", "code"), CASES)
def test_failure_is_detected_and_classified(pod, process_exit, kind, reason, code):
    pods = {0: pod} if pod is not None else {}
    exits = {0: process_exit} if process_exit is not None else {}
    (failure,) = detect_failures(pods, NODES, 1, frozenset({0}), exits)
    assert (failure.kind, failure.reason, failure.exit_code) == (kind, reason, code)
    assert failure.detail and failure.detail[0].islower()


@pytest.mark.parametrize("pod", [
    pytest.param(_pod(), id="a ready pod on a ready node"),
    pytest.param(_pod(phase="Pending", node_name="", ready=False), id="a pod not yet scheduled"),
    pytest.param(_pod(phase="Succeeded"), id="a pod that finished successfully"),
])
def test_healthy_ranks_are_not_failures(pod):
    assert detect_failures({0: pod}, NODES, 1, frozenset({0}), {0: 0}) == ()


def test_a_process_the_oom_killer_ended_is_reported_as_out_of_memory_with_its_words():
    words = ("out of memory: the kernel's OOM killer ended the training process at the "
             "container's memory limit (256 MiB); raise ...\nlast line of the log")
    (failure,) = detect_failures({0: _pod()}, NODES, 1, frozenset({0}), {0: -9}, {0: words})
    assert (failure.kind, failure.reason, failure.exit_code) == (
        FailureKind.SOFTWARE, FailureReason.OOM_KILLED, -9)
    assert failure.detail == words.splitlines()[0]
    assert "last line of the log" in failure.log_tail
    (plain,) = detect_failures({0: _pod()}, NODES, 1, frozenset({0}), {0: -9},
                               {0: "killed\nout of memory: not the first line"})
    assert plain.reason == FailureReason.ERROR


def test_ranks_not_expected_to_run_are_not_checked():
    assert detect_failures({}, NODES, 2, frozenset({1}))[0].rank == 1


def test_hang_is_every_rank_after_the_timeout_without_progress():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    fresh = Progress(10, now - timedelta(seconds=59))
    stale = Progress(10, now - timedelta(seconds=61))
    assert detect_hang(fresh, now, 60, [0, 1]) == ()
    assert detect_hang(None, now, 60, [0, 1]) == ()
    hung = detect_hang(stale, now, 60, [0, 1])
    assert [f.rank for f in hung] == [0, 1] and {f.kind for f in hung} == {FailureKind.HANG}


def _failure(reason=FailureReason.ERROR, code=None):
    return RankFailure(0, FailureKind.HARDWARE, reason, code, "x")


OOM = FailureRule("oom", RuleAction.FAIL_JOB, on_pod_failure_reasons=frozenset({"OOMKilled"}))
DATA = FailureRule("bad-data", RuleAction.RESTART_JOB_AND_IGNORE_MAX_RESTARTS,
                   on_exit_codes=frozenset({3}))
BOTH = FailureRule("both", RuleAction.FAIL_JOB, frozenset({1}), frozenset({"Error"}))

RULES = [
    pytest.param([OOM, DATA], _failure(FailureReason.OOM_KILLED, 137), "oom",
                 id="a reason rule matches its reason whatever the exit code"),
    pytest.param([OOM, DATA], _failure(code=3), "bad-data",
                 id="an exit-code rule matches its code"),
    pytest.param([OOM, DATA], _failure(code=4), None, id="no rule matches another code"),
    pytest.param([DATA], _failure(code=None), None, id="a code rule never matches a lost pod"),
    pytest.param([BOTH], _failure(FailureReason.ERROR, 1), "both",
                 id="a rule with codes and reasons needs both"),
    pytest.param([BOTH], _failure(FailureReason.EVICTED, 1), None,
                 id="a rule with codes and reasons fails if the reason differs"),
    pytest.param([DATA, FailureRule("any3", RuleAction.FAIL_JOB, frozenset({3}))],
                 _failure(code=3), "bad-data", id="the first matching rule wins"),
]


@pytest.mark.parametrize(("rules", "failure", "name"), RULES)
def test_rule_matching(rules, failure, name):
    rule = matching_rule(rules, failure)
    assert (rule.name if rule else None) == name


def test_fail_job_wins_over_other_rules_for_simultaneous_failures():
    policy = FailurePolicy(rules=(OOM, DATA))
    got = apply_policy(policy, [_failure(code=3), _failure(FailureReason.OOM_KILLED)])
    assert got.action is RuleAction.FAIL_JOB and got.rule == OOM


def test_recovery_is_free_only_when_every_failure_matches_an_ignore_rule():
    policy = FailurePolicy(rules=(DATA,))
    assert apply_policy(policy, [_failure(code=3)]).counts is False
    assert apply_policy(policy, [_failure(code=3), _failure(code=9)]).counts is True


def test_views_parse_api_objects():
    pod = pod_view({
        "metadata": {"name": "j-worker-1", "uid": "u1", "deletionTimestamp": "t",
                     "ownerReferences": [{"uid": "job-uid", "controller": True}],
                     "labels": {"gemini.io/rank": "1", "gemini.io/restart-attempt": "2"}},
        "spec": {"nodeName": "n3"},
        "status": {"phase": "Failed", "podIP": "10.0.0.5",
                   "conditions": [{"type": "Ready", "status": "True"},
                                  {"type": "DisruptionTarget", "status": "True",
                                   "reason": "DeletionByTaintManager"}],
                   "containerStatuses": [{"name": "trainer", "state": {
                       "terminated": {"exitCode": 9, "reason": "Error"}}}]},
    })
    assert pod is not None
    assert (pod.rank, pod.attempt, pod.node_name, pod.ready, pod.deleting) == (1, 2, "n3", True,
                                                                               True)
    assert pod.trainer_exit == ContainerExit(9, "Error")
    assert pod.disruption_reason == "DeletionByTaintManager" and pod.ip == "10.0.0.5"
    assert pod.owner_uid == "job-uid"
    assert pod_view({"metadata": {"name": "other"}}) is None
    node = node_view({"metadata": {"name": "n3", "labels": {
        "topology.kubernetes.io/zone": "z1", "topology.gemini.io/rack": "r2"}},
        "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}})
    assert (node.ready, node.zone, node.rack) == (False, "z1", "r2")
