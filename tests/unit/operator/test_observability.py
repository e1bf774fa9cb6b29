"""Replica coverage from the sidecars' inventories, when failures became visible in the API,
and the metrics both feed; placement delivery to sidecars that do not answer."""

from __future__ import annotations

import platform
import socket
from datetime import UTC, datetime
from typing import Any

import pytest

from gemini import metric_labels
from gemini.control.inventory import Inventory
from gemini.domain.placement import Placement
from gemini_operator.calls.poller import replica_coverage
from gemini_operator.calls.sidecars import DeliveryError, SidecarAddress, deliver_placement
from gemini_operator.core.conditions import State
from gemini_operator.core.observed import (
    detection_lags,
    failure_visible_at,
    node_view,
    pod_view,
)
from gemini_operator.core.status import CheckpointStatus, JobStatus, ReplicaCoverage
from gemini_operator.runtime.metrics import JobReport, OperatorMetrics
from tests.unit.operator.builders import inventory

ACTED = datetime(2026, 11, 29, 18, 0, 10, tzinfo=UTC)
# Ring placement of 4 ranks, m = 2: rank r's shard is held by r and r + 1.
HOLDERS = {r: [r, (r + 1) % 4] for r in range(4)}


def _inventory(rank: int, local: dict[int, bool], replicas: dict[tuple[int, int], bool]
               ) -> Inventory:
    """A sidecar's GET /inventory: its own versions, and (rank, version) held for peers."""
    return inventory(rank, local.items(), [(r, v, c) for (r, v), c in replicas.items()])


def _ring(version: int, skip: frozenset[int] = frozenset()) -> dict[int, Inventory]:
    """Every rank holds `version` of its own shard and of its left neighbour's, except the
    replicas held for the ranks in `skip`."""
    return {r: _inventory(r, {version: True},
                          {((r - 1) % 4, version): (r - 1) % 4 not in skip})
            for r in range(4)}


def test_every_shard_with_all_copies_complete_counts() -> None:
    assert replica_coverage(_ring(7), HOLDERS) == ReplicaCoverage(4, 4, 7)


def test_an_incomplete_replica_or_a_silent_holder_leaves_its_shard_out() -> None:
    assert replica_coverage(_ring(7, frozenset({2})), HOLDERS) == ReplicaCoverage(3, 4, 7)
    silent = _ring(7)
    del silent[1]  # holds rank 1's own copy and rank 0's replica
    assert replica_coverage(silent, HOLDERS) == ReplicaCoverage(2, 4, 7)


def test_coverage_is_taken_at_the_step_most_shards_have_fully_replicated() -> None:
    # Step 8 is local everywhere but replicated for one shard only; step 7 for all of them.
    inventories = {r: _inventory(r, {7: True, 8: True},
                                 {((r - 1) % 4, 7): True, ((r - 1) % 4, 8): r == 1})
                   for r in range(4)}
    assert replica_coverage(inventories, HOLDERS) == ReplicaCoverage(4, 4, 7)


def test_nothing_held_is_zero_coverage_of_every_shard() -> None:
    assert replica_coverage({r: inventory(r) for r in range(4)}, HOLDERS) == ReplicaCoverage(
        0, 4, None)
    assert replica_coverage({}, {}) == ReplicaCoverage(0, 0, None)


def test_holders_come_from_the_published_placement() -> None:
    published = {"replicas": 2, "strategy": "group", "reason": "", "groups": [[0, 1]],
                 "holders": {"0": [0, 1], "1": [1, 0]}, "restartAttempt": 0,
                 "nodes": {"0": "n0", "1": "n1"}}
    assert JobStatus.from_dict({"placement": published}).placement.layout.holders == {
        0: (0, 1), 1: (1, 0)}
    assert JobStatus.from_dict({}).placement is None


def test_coverage_round_trips_through_the_status_document() -> None:
    raw = {"checkpoint": {"inMemoryStep": 7,
                          "replicaCoverage": {"complete": 3, "total": 4, "step": 7}}}
    status = JobStatus.from_dict(raw)
    assert status.checkpoint.replica_coverage == ReplicaCoverage(3, 4, 7)
    assert status.to_dict()["checkpoint"] == raw["checkpoint"]
    assert "replicaCoverage" not in JobStatus.from_dict({}).to_dict()["checkpoint"]


def _pod(**status: Any) -> dict[str, Any]:
    meta = status.pop("meta", {})
    return {"metadata": {"name": "train-worker-0", "labels": {"gemini.io/rank": "0"}, **meta},
            "spec": {"nodeName": "n0"}, "status": status}


def _terminated(finished: str, key: str = "state") -> dict[str, Any]:
    return {"name": "trainer", key: {"terminated": {"exitCode": 1, "finishedAt": finished}}}


def test_a_crash_is_visible_from_the_trainers_finished_at() -> None:
    pod = pod_view(_pod(phase="Failed", containerStatuses=[_terminated("2026-11-29T18:00:07Z")]))
    assert failure_visible_at("Error", pod, None) == datetime(2026, 11, 29, 18, 0, 7, tzinfo=UTC)
    restarted = pod_view(_pod(phase="Running", containerStatuses=[
        {**_terminated("2026-11-29T18:00:04Z", "lastState"), "state": {"running": {}}}]))
    assert failure_visible_at("OOMKilled", restarted, None) == datetime(
        2026, 11, 29, 18, 0, 4, tzinfo=UTC)


def test_a_deletion_is_visible_from_its_request_not_the_end_of_its_grace() -> None:
    pod = pod_view(_pod(phase="Running", meta={"deletionTimestamp": "2026-11-29T18:00:38Z",
                                               "deletionGracePeriodSeconds": 30}))
    assert failure_visible_at("PodDeleted", pod, None) == datetime(
        2026, 11, 29, 18, 0, 8, tzinfo=UTC)


def test_a_lost_node_is_visible_from_its_ready_transition() -> None:
    node = node_view({"metadata": {"name": "n0"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-11-29T18:00:05Z"}]}})
    pod = pod_view(_pod(phase="Running"))
    assert failure_visible_at("NodeLost", pod, node) == datetime(
        2026, 11, 29, 18, 0, 5, tzinfo=UTC)
    assert failure_visible_at("NodeLost", None, node) is None  # the pod is gone: no record
    assert failure_visible_at("Hang", pod, node) is None


def test_a_disruption_is_visible_from_its_condition_when_true() -> None:
    def pod(status: str) -> Any:
        return pod_view(_pod(phase="Running", conditions=[
            {"type": "DisruptionTarget", "status": status,
             "lastTransitionTime": "2026-11-29T18:00:06Z"}]))

    assert failure_visible_at("Evicted", pod("True"), None) == datetime(
        2026, 11, 29, 18, 0, 6, tzinfo=UTC)
    assert failure_visible_at("Evicted", pod("False"), None) is None


def test_detection_lag_is_per_cause_from_its_earliest_failure() -> None:
    pods = {r: pod_view(_pod(phase="Failed", containerStatuses=[
        _terminated(f"2026-11-29T18:00:0{r + 2}Z")])) for r in range(3)}
    views = {r: p for r, p in pods.items() if p is not None}
    lags = detection_lags([(2, "Error"), (1, "Error"), (5, "PodDeleted")], views, {}, ACTED)
    assert lags == {"Error": 7.0}
    # A clock behind the API's whole seconds never makes a negative lag.
    assert detection_lags([(0, "Error")], views, {}, datetime(
        2026, 11, 29, 18, 0, 1, tzinfo=UTC)) == {"Error": 0.0}



def test_a_failure_no_container_showed_is_timed_by_its_launchers_parking() -> None:
    """A training process restarted in place stops no container: the API has no time for
    it, the launcher's parked epoch has (and an API time, when there is one, comes first)."""
    running = pod_view(_pod(phase="Running"))
    stopped = pod_view(_pod(phase="Failed", containerStatuses=[
        _terminated("2026-11-29T18:00:02Z")]))
    assert running is not None and stopped is not None
    parked = {0: datetime(2026, 11, 29, 18, 0, 8, 500000, tzinfo=UTC),
              1: datetime(2026, 11, 29, 18, 0, 8, tzinfo=UTC)}
    assert detection_lags([(0, "Error")], {0: running}, {}, ACTED) == {}
    assert detection_lags([(0, "Error")], {0: running}, {}, ACTED, parked) == {"Error": 1.5}
    assert detection_lags([(1, "Error")], {1: stopped}, {}, ACTED, parked) == {"Error": 8.0}


JOB = {"geminijob_namespace": "ns", "geminijob": "job"}


def test_coverage_and_detection_metrics_are_exported_per_job_and_cause() -> None:
    metrics = OperatorMetrics()
    metrics.replica_coverage(("ns", "job"), ReplicaCoverage(3, 4, 7))
    metrics.detection_seconds.labels(cause="NodeLost").observe(1.5)
    value = metrics.registry.get_sample_value
    assert value("gemini_operator_replica_coverage_complete_shards", JOB) == 3
    assert value("gemini_operator_replica_coverage_shards", JOB) == 4
    assert value("gemini_operator_failure_detection_seconds_count", {"cause": "NodeLost"}) == 1
    metrics.replica_coverage(("ns", "job"), None)
    metrics.replica_coverage(("ns", "never"), None)
    assert value("gemini_operator_replica_coverage_complete_shards", JOB) is None


def test_a_reconcile_exports_the_job_with_timestamps_not_ages() -> None:
    metrics = OperatorMetrics()
    value = metrics.registry.get_sample_value
    checkpoint = CheckpointStatus(persisted_time="2026-11-29T18:00:00Z",
                                  replica_coverage=ReplicaCoverage(4, 4, 7),
                                  recoverable_step=7, effective_interval=1,
                                  replication_lag_steps=2)
    metrics.reconciled(("ns", "job"), JobReport(State.RECOVERING, checkpoint, 1.5e9, 600), 0.2)
    assert value("gemini_operator_persisted_checkpoint_timestamp_seconds", JOB) == datetime(
        2026, 11, 29, 18, 0, tzinfo=UTC).timestamp()
    assert value("gemini_operator_persist_interval_seconds", JOB) == 600
    assert value("gemini_operator_recovery_started_timestamp_seconds", JOB) == 1.5e9
    assert value("gemini_operator_replication_lag_steps", JOB) == 2
    assert value("gemini_operator_job_state", {**JOB, "state": "Recovering"}) == 1
    assert value("gemini_operator_jobs", {"state": "Recovering"}) == 1
    # Recovered: no recovery under way, one state series, the other states' counts move.
    metrics.reconciled(("ns", "job"), JobReport(State.RUNNING, checkpoint), 0.1)
    assert value("gemini_operator_recovery_started_timestamp_seconds", JOB) is None
    assert value("gemini_operator_persist_interval_seconds", JOB) is None
    assert value("gemini_operator_job_state", {**JOB, "state": "Recovering"}) is None
    assert value("gemini_operator_job_state", {**JOB, "state": "Running"}) == 1
    assert value("gemini_operator_jobs", {"state": "Recovering"}) == 0
    metrics.forget(("ns", "job"))
    names = {s.name for f in metrics.registry.collect() for s in f.samples}
    assert not [s for f in metrics.registry.collect() for s in f.samples
                if s.labels.get("geminijob") == "job"], names


def test_a_replica_that_stops_leading_exports_no_job() -> None:
    metrics = OperatorMetrics()
    for name in ("a", "b"):
        metrics.reconciled(("ns", name), JobReport(State.RUNNING, CheckpointStatus(
            persisted_time="2026-11-29T18:00:00Z", replica_coverage=ReplicaCoverage(1, 2))),
            0.1)
    metrics.forget_all()
    assert not [s for f in metrics.registry.collect() for s in f.samples if "geminijob" in
                s.labels]
    assert metrics.registry.get_sample_value("gemini_operator_jobs", {"state": "Running"}) == 0


def test_the_operator_exports_its_process_and_build() -> None:
    value = OperatorMetrics().registry.get_sample_value
    assert value("process_resident_memory_bytes") > 0
    labels = {"version": metric_labels.version(), "python_version": platform.python_version()}
    assert value("gemini_operator_build_info", labels) == 1


@pytest.fixture
def closed_port() -> int:
    """A loopback port nobody listens on (a sidecar not started, a fake node's pod)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_delivery_tries_every_sidecar_and_says_how_many_did_not_answer(closed_port: int
                                                                      ) -> None:
    addresses = {r: SidecarAddress(r, "127.0.0.1", closed_port, 7000 + r) for r in range(4)}
    placement = Placement(2, ((0, 1, 2, 3),), {r: tuple(HOLDERS[r]) for r in range(4)}, "mixed",
                          "a ring of 4")
    with pytest.raises(DeliveryError) as err:
        deliver_placement(placement, addresses, "token", timeout=1.0)
    assert (err.value.failed, err.value.total) == (4, 4)
    assert "rank 0: /peers unreachable" in str(err.value) and "(and 1 more)" in str(err.value)


def test_a_re_list_of_some_ranks_replaces_only_those_ranks_in_the_cache() -> None:
    from gemini_operator.cluster.cache import ClusterCache

    def pod(rank: int, uid: str) -> dict[str, Any]:
        labels = {"gemini.io/job-name": "train", "gemini.io/rank": str(rank)}
        return {"metadata": {"name": f"train-worker-{rank}", "namespace": "ns", "uid": uid,
                             "labels": labels}, "status": {"phase": "Running"}}

    cache = ClusterCache()
    cache.update_job({"metadata": {"name": "train", "namespace": "ns"}}, deleted=False)
    for rank in range(3):
        cache.update_pod(pod(rank, f"old{rank}"), deleted=False)
    # Rank 1 was replaced, rank 2 is gone; rank 0 was not asked about and stays.
    cache.replace_ranks(("ns", "train"), {1, 2}, [pod(1, "new1"), pod(0, "stray")])
    snap = cache.snapshot(("ns", "train"))
    assert snap is not None
    assert {r: p.uid for r, p in snap.pods.items()} == {0: "old0", 1: "new1"}


def test_recovery_counters_exist_at_zero_before_the_first_recovery() -> None:
    """increase() cannot see a counter's first increment when the series is born with it: a
    job's first recovery from S3 would read 0 on the dashboard."""
    value = OperatorMetrics().registry.get_sample_value
    assert value("gemini_operator_recoveries_finished_total",
                 {"cause": "hardware", "source": "S3"}) == 0
    assert value("gemini_operator_recoveries_finished_total",
                 {"cause": "resume", "source": "S3"}) == 0
    assert value("gemini_operator_recoveries_total", {"kind": "hang"}) == 0
