"""Leader election decisions, the watch cache, status patches, sidecar placement bodies,
conditions bookkeeping."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gemini.domain.placement import mixed_placement
from gemini_operator.calls.sidecars import SidecarAddress, peers_bodies
from gemini_operator.cluster.cache import ClusterCache
from gemini_operator.core import conditions as cond
from gemini_operator.core.status import JobStatus, status_patch
from gemini_operator.runtime.election import decide
from gemini_operator.runtime.metrics import OperatorMetrics

NOW = datetime(2026, 11, 29, 18, 0, 0, tzinfo=UTC)


def _decided(*args: Any) -> Any:
    """decide(...) with its write typed loosely, for indexing in asserts."""
    return decide(*args)


def _snap(cache: ClusterCache, key: Any) -> Any:
    snap = cache.snapshot(key)
    assert snap is not None
    return snap


def _lease(holder, renewed, rv="7", transitions=3):
    return {"metadata": {"name": "op", "resourceVersion": rv},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                     "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                     "acquireTime": "2026-11-29T17:00:00.000000Z",
                     "leaseTransitions": transitions}}


def test_no_lease_is_created_and_held():
    got = _decided(None, "me", NOW, 15, "op")
    assert got.leads and got.write["spec"]["holderIdentity"] == "me"
    assert "resourceVersion" not in got.write["metadata"]


def test_a_live_lease_of_another_replica_is_left_alone():
    got = _decided(_lease("other", NOW - timedelta(seconds=5)), "me", NOW, 15, "op")
    assert not got.leads and got.write is None


def test_an_expired_lease_is_taken_over_with_a_transition():
    got = _decided(_lease("other", NOW - timedelta(seconds=16)), "me", NOW, 15, "op")
    assert got.leads
    assert got.write["metadata"]["resourceVersion"] == "7"  # replace, guarded by the version
    assert got.write["spec"]["leaseTransitions"] == 4


def test_our_own_lease_is_renewed_keeping_its_acquire_time():
    got = _decided(_lease("me", NOW - timedelta(seconds=2)), "me", NOW, 15, "op")
    assert got.leads and got.write["spec"]["acquireTime"] == "2026-11-29T17:00:00.000000Z"
    assert got.write["spec"]["leaseTransitions"] == 3


def _pod(name, rank, node, uid="u", job="train"):
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid,
                         "labels": {"gemini.io/job-name": job, "gemini.io/rank": str(rank)}},
            "spec": {"nodeName": node}, "status": {"phase": "Running"}}


def _node(name, ready="True", zone="z"):
    return {"metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}


def test_cache_routes_pod_events_to_their_job_and_drops_deleted_pods():
    cache = ClusterCache()
    cache.update_job({"metadata": {"namespace": "ns", "name": "train"}}, deleted=False)
    assert cache.update_pod(_pod("train-worker-0", 0, "n0"), False) == [("ns", "train")]
    assert cache.update_pod({"metadata": {"name": "x", "labels": {}}}, False) == []
    snap = _snap(cache, ("ns", "train"))
    assert snap.pods[0].node_name == "n0"
    # A late DELETED event of an older pod of the same rank must not drop the new one.
    cache.update_pod(_pod("train-worker-0", 0, "n1", uid="new"), False)
    cache.update_pod(_pod("train-worker-0", 0, "n0", uid="u"), True)
    assert _snap(cache, ("ns", "train")).pods[0].uid == "new"
    cache.update_pod(_pod("train-worker-0", 0, "n1", uid="new"), True)
    assert _snap(cache, ("ns", "train")).pods == {}


def test_node_events_concern_jobs_only_when_readiness_or_labels_change():
    cache = ClusterCache()
    cache.update_job({"metadata": {"namespace": "ns", "name": "train"}}, deleted=False)
    cache.update_pod(_pod("train-worker-0", 0, "n0"), False)
    assert cache.update_node(_node("n0"), False) == [("ns", "train")]
    assert cache.update_node(_node("n0"), False) == []  # a heartbeat
    assert cache.update_node(_node("n0", ready="Unknown"), False) == [("ns", "train")]
    assert cache.update_node(_node("n9", ready="False"), False) == []  # no pods there


def test_cache_keeps_our_newer_status_write_over_an_older_watch_event():
    cache = ClusterCache()
    key = ("ns", "train")
    cache.update_job({"metadata": {"namespace": "ns", "name": "train", "resourceVersion": "10"},
                      "status": {"restarts": 1}}, False)
    cache.update_job({"metadata": {"namespace": "ns", "name": "train", "resourceVersion": "9"},
                      "status": {"restarts": 0}}, False)
    assert _snap(cache, key).job["status"] == {"restarts": 1}


def test_status_patch_is_none_when_nothing_changed_and_nulls_removed_keys():
    old = {"a": 1, "b": {"x": 1}, "gone": 3}
    assert status_patch(old, {"a": 1, "b": {"x": 1}, "gone": 3}) is None
    assert status_patch(old, {"a": 2, "b": {"x": 1}}) == {"a": 2, "gone": None}


def test_status_round_trips_through_its_document():
    status = JobStatus(observed_generation=3, restarts=2, start_time="2026-11-29T18:00:00Z",
                       conditions=(cond.ALL_WORKERS_READY.condition("t", 3, total=4),))
    doc = status.to_dict()
    assert doc["state"] == "Running"
    assert JobStatus.from_dict(doc).to_dict() == doc


def test_upsert_keeps_the_transition_time_while_the_status_holds():
    first = cond.WORKERS_STARTING.condition("t1", 1, ready=0, total=4)
    again = cond.WORKERS_STARTING.condition("t2", 2, ready=1, total=4)
    (kept,) = cond.upsert((first,), again)
    assert kept.last_transition_time == "t1" and kept.message == "1 of 4 workers are ready"
    (moved,) = cond.upsert((first,), cond.ALL_WORKERS_READY.condition("t3", 2, total=4))
    assert moved.last_transition_time == "t3"


@pytest.mark.parametrize(("types", "state"), [
    ((), cond.State.CREATED),
    ((cond.ALL_WORKERS_READY,), cond.State.RUNNING),
    ((cond.ALL_WORKERS_READY, cond.RECOVERY_NEEDED), cond.State.RECOVERING),
    ((cond.ALL_WORKERS_READY, cond.JOB_SUSPENDED), cond.State.SUSPENDED),
    ((cond.JOB_SUSPENDED, cond.INVALID_SPEC), cond.State.FAILED),
])
def test_state_is_the_most_telling_true_condition(types, state):
    conditions: tuple[cond.Condition, ...] = ()
    for reason in types:
        conditions = cond.upsert(conditions, reason.condition("t", 1, total=1, cause="c",
                                                              intent="p", detail="d"))
    assert cond.state_of(conditions) is state


def test_every_reason_is_camel_case_with_a_lower_case_message():
    reasons = [v for v in vars(cond).values() if isinstance(v, cond.Reason)]
    assert len({r.reason + r.type for r in reasons}) == len(reasons)
    for reason in reasons:
        assert reason.reason[0].isupper() and " " not in reason.reason
        assert reason.template[0].islower() or reason.template[0] == "{"


def test_each_sidecar_gets_its_holds_targets_and_their_addresses():
    placement = mixed_placement(3, 2)  # a ring: 0 -> 1 -> 2 -> 0
    addresses = {r: SidecarAddress(r, f"10.0.0.{r}", 7071, 7070) for r in range(3)}
    bodies = {r: b.to_json() for r, b in peers_bodies(placement, addresses).items()}
    assert bodies[0] == {"peers": {"1": "10.0.0.1:7070", "2": "10.0.0.2:7070"},
                         "hold_ranks": [2], "send_to": [1]}
    assert bodies[2]["send_to"] == [0] and bodies[2]["hold_ranks"] == [1]


def test_jobs_by_state_gauge_follows_each_jobs_latest_state():
    metrics = OperatorMetrics()
    metrics.job_state(("ns", "a"), cond.State.RUNNING)
    metrics.job_state(("ns", "b"), cond.State.RUNNING)
    metrics.job_state(("ns", "a"), cond.State.RECOVERING)
    metrics.job_state(("ns", "b"), None)

    def value(state: str) -> float | None:
        return metrics.registry.get_sample_value("gemini_operator_jobs", {"state": state})

    assert (value("Running"), value("Recovering")) == (0, 1)


def test_every_event_reason_is_explained_with_its_type() -> None:
    from pathlib import Path

    from gemini_operator.core.events import WARNINGS, EventReason

    docs = (Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md").read_text()
    for reason in EventReason:
        kind = "Warning" if reason in WARNINGS else "Normal"
        assert f"| `{reason.value}` | {kind} |" in docs, reason
