"""Operator fixes found by the fault matrix (tests/e2e/test_fault_matrix_a.py), pinned here."""

from __future__ import annotations

from typing import Any

from gemini.control.inventory import Inventory
from gemini.control.messages import Peers
from gemini.domain.placement import mixed_placement
from gemini_operator.calls.placement_delivery import stale_placements
from gemini_operator.calls.sidecars import SidecarAddress, peers_bodies
from tests.unit.operator.builders import inventory

ADDRESSES = {r: SidecarAddress(r, f"10.0.0.{r}", 7071, 7070) for r in range(4)}
PLACEMENT = mixed_placement(4, 2)  # groups {0, 1} and {2, 3}


def _inventory(hold: list[int], send: list[int]) -> Inventory:
    return inventory(0, placement=Peers({}, tuple(hold), tuple(send)))


def test_a_restarted_sidecar_without_its_placement_gets_it_again() -> None:
    bodies = peers_bodies(PLACEMENT, ADDRESSES)
    inventories = {0: _inventory([1], [1]), 1: _inventory([], []), 2: _inventory([3], [3]),
                   3: _inventory([2], [2])}
    stale = stale_placements(inventories, bodies)
    assert stale == {1: bodies[1]}
    assert stale[1].hold_ranks == (0,) and stale[1].send_to == (0,)


def test_sidecars_with_the_delivered_placement_are_left_alone() -> None:
    bodies = peers_bodies(PLACEMENT, ADDRESSES)
    inventories = {r: _inventory(list(b.hold_ranks), list(b.send_to))
                   for r, b in bodies.items()}
    assert stale_placements(inventories, bodies) == {}
    assert stale_placements({}, bodies) == {}  # a silent sidecar is not judged
    wrong = {2: _inventory([3], [1])}  # holds the right shard, sends to the wrong peer
    assert stale_placements(wrong, bodies) == {2: bodies[2]}


def test_one_delivery_path_sends_to_the_stale_sidecars_only() -> None:
    import socket

    import pytest

    from gemini_operator.calls.placement_delivery import deliver, stale_ranks
    from gemini_operator.calls.sidecars import DeliveryError
    from gemini_operator.core.observed import PodView
    from gemini_operator.core.render import RenderConfig

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = free.getsockname()[1]  # nothing listens once the socket is closed
    ports = RenderConfig(sidecar_port=closed - 1)  # the API port is the next one
    pods = {r: PodView(f"p{r}", r, 0, f"u{r}", "Running", ip="127.0.0.1") for r in range(4)}
    inventories = {0: _inventory([1], [1]), 1: _inventory([], [])}
    assert stale_ranks(PLACEMENT, pods, ports, inventories) == [1]
    with pytest.raises(DeliveryError) as err:
        deliver(PLACEMENT, pods, ports, "token", ranks=[1], timeout=1.0)
    assert (err.value.failed, err.value.total) == (1, 1) and "rank 1" in str(err.value)


def test_a_hung_job_is_reconciled_again_when_its_hang_timeout_runs_out() -> None:
    from datetime import timedelta

    from gemini_operator.calls.worker_calls import launch_record
    from gemini_operator.core.failures import Progress
    from tests.unit.operator.builders import make_job
    from tests.unit.operator.test_decide import CONFIG, Harness

    h = Harness(make_job().set("failurePolicy.hangTimeoutSeconds", 60))
    h.step()
    h.run_pods()
    h.step()
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    h.progress = Progress(9, h.now)  # type: ignore[attr-defined]
    h.now += timedelta(seconds=20)
    decision = h.step()
    # Nothing else changes while a job hangs: the reconcile must ask to be called back.
    assert decision.requeue_after is not None and 40 <= decision.requeue_after <= 42


def test_progress_from_before_a_restart_does_not_count_towards_a_hang() -> None:
    from dataclasses import replace
    from datetime import UTC, datetime

    from gemini_operator.calls.poller import CheckpointPoller, Findings
    from gemini_operator.calls.tokens import JobTokens
    from gemini_operator.cluster.cache import ClusterCache
    from gemini_operator.core.failures import Progress
    from gemini_operator.core.status import CheckpointStatus
    from tests.unit.operator.test_decide import CONFIG

    cache = ClusterCache()
    job: dict[str, Any] = {"metadata": {"namespace": "ns", "name": "train", "uid": "u"},
                           "spec": {}, "status": {"launch": {"epoch": 1, "restartAttempt": 0}}}
    cache.update_job(job, deleted=False)
    poller = CheckpointPoller(None, cache, CONFIG, JobTokens(None, None))  # type: ignore[arg-type]
    seen = Findings(CheckpointStatus(), Progress(7, datetime(2026, 1, 1, tzinfo=UTC)), epoch=1)
    poller._found[("ns", "train")] = seen
    assert poller.findings(("ns", "train")) == seen
    job["status"]["launch"]["epoch"] = 2  # a recovery restarted every launcher
    cache.update_job(job, deleted=False)
    assert poller.findings(("ns", "train")) == replace(seen, progress=None)
