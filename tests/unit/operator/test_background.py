"""Sidecar calls off the reconcile path: a reconcile that starts a placement delivery returns
at once, even when a sidecar holds the request for the whole timeout; the call's end wakes the
job and the next reconcile records the outcome."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from gemini.domain.placement import mixed_placement
from gemini_operator.calls.background import BackgroundCalls, Finished, Running
from gemini_operator.calls.sidecars import DELIVERY_TIMEOUT_SECONDS
from gemini_operator.cluster.cache import ClusterCache, Snapshot
from gemini_operator.core.actions import DeliverPlacement
from gemini_operator.core.observed import PodView
from gemini_operator.core.records import PlacementRecord
from gemini_operator.core.render import RenderConfig
from gemini_operator.core.status import JobStatus
from gemini_operator.core.types import JobView, ReconcileConfig
from gemini_operator.runtime.status_writer import JobStatusWriter
from gemini_operator.runtime.wiring import build_reconciler
from tests.unit.operator.fake_kube import FakeKube

KEY = ("ns", "job")


def test_a_call_is_running_then_finished_once_and_wakes_its_job() -> None:
    woken: list[Any] = []
    calls = BackgroundCalls(woken.append)
    release = threading.Event()
    assert calls.take(KEY, "a") is None
    calls.start(KEY, "a", lambda: release.wait(5) and 7)
    assert calls.take(KEY, "a") == Running()
    release.set()
    deadline = time.monotonic() + 5
    while not woken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert woken == [KEY]
    assert calls.take(KEY, "a") == Finished(value=7)
    assert calls.take(KEY, "a") is None  # taken once


def test_a_failed_call_hands_over_its_error() -> None:
    calls = BackgroundCalls()
    error = ValueError("refused")

    def fail() -> None:
        raise error

    calls.start(KEY, "a", fail)
    deadline = time.monotonic() + 5
    while isinstance(taken := calls.take(KEY, "a"), Running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert taken == Finished(error=error)


def test_a_result_for_an_input_that_changed_is_dropped() -> None:
    calls = BackgroundCalls()
    calls.start(KEY, "old placement", lambda: 1)
    time.sleep(0.1)
    assert calls.take(KEY, "new placement") is None
    assert calls.take(KEY, "old placement") is None  # dropped, not kept for later


@pytest.fixture
def silent_sidecar() -> Iterator[int]:
    """An API port that takes connections (the kernel's backlog) but never answers, as a sidecar
    still starting up does: a POST to it waits for its whole timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_a_silent_sidecar_does_not_hold_the_reconcile(silent_sidecar: int) -> None:
    woken = threading.Event()
    config = ReconcileConfig(render=RenderConfig(sidecar_port=silent_sidecar - 1))
    kube = FakeKube(secrets={("ns", "job-peer-auth"): {"token": "token"}})  # the peer-auth token
    reconciler = build_reconciler(kube, ClusterCache(), config,  # type: ignore[arg-type]
                                  wake=lambda key: woken.set())
    job = JobView.from_object({"metadata": {"name": "job", "namespace": "ns", "uid": "u"},
                               "spec": {"numNodes": 1}})
    pod = PodView(name="job-worker-0", rank=0, attempt=0, uid="p", phase="Running",
                  ip="127.0.0.1")
    snap = Snapshot(job={}, pods={0: pod}, nodes={})
    action = DeliverPlacement(PlacementRecord(mixed_placement(1, 1), 0, {0: ""}))

    call = JobStatusWriter(reconciler.status, job, JobStatus(), datetime.now)
    started = time.monotonic()
    reconciler.deliveries.deliver(call, job, snap, action)
    assert time.monotonic() - started < 0.5 < DELIVERY_TIMEOUT_SECONDS
    assert call.outcomes == []  # started: nothing to record yet
    reconciler.deliveries.deliver(call, job, snap, action)  # still in flight: nothing recorded
    (waiting,) = call.outcomes
    assert waiting.conditions == [] and waiting.requeue_after is not None

    assert woken.wait(DELIVERY_TIMEOUT_SECONDS + 5), "the call's end did not wake the job"
    assert time.monotonic() - started >= DELIVERY_TIMEOUT_SECONDS * 0.9
    call = JobStatusWriter(reconciler.status, job, JobStatus(), datetime.now)
    reconciler.deliveries.deliver(call, job, snap, action)
    (outcome,) = call.outcomes
    (condition,) = outcome.conditions
    assert (condition.type, condition.reason) == ("PlacementDelivered", "SidecarsUnreachable")
    assert outcome.requeue_after is not None and outcome.requeue_after > 0  # retried later
