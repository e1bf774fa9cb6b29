"""A lost node presumed from the job's own signals (silence.py, cache.presume_lost)."""

from __future__ import annotations

import socket
from dataclasses import replace
from datetime import UTC, datetime

from gemini_operator.calls.sidecars import refusing
from gemini_operator.calls.tokens import JobTokens
from gemini_operator.calls.worker_calls import WorkerCalls
from gemini_operator.cluster.cache import ClusterCache
from gemini_operator.core.failures import FailureReason, detect_failures
from gemini_operator.core.observed import PodView
from gemini_operator.core.records import RecoveryRecord
from gemini_operator.core.render import RenderConfig
from gemini_operator.core.silence import SilenceTracker, suspects
from gemini_operator.core.status import JobStatus
from gemini_operator.core.types import JobView
from gemini_operator.steps.recovery import RecoveryExecutor
from tests.unit.operator.test_decide import CONFIG
from tests.unit.operator.test_recovery import RECOVERY_DOC


def pod(rank: int, uid: str = "", **kw: object) -> PodView:
    fields: dict[str, object] = {"name": f"w-{rank}", "rank": rank, "attempt": 0,
                                 "uid": uid or f"u{rank}", "phase": "Running",
                                 "node_name": f"n{rank}", "ready": True, "ip": "10.0.0.1"}
    fields.update(kw)
    return PodView(**fields)  # type: ignore[arg-type]


def test_a_pod_silent_past_the_confirmation_time_presumes_its_node_lost() -> None:
    tracker = SilenceTracker(silent_s=3.0)
    pods = {0: pod(0), 1: pod(1)}
    probe = suspects(pods, answering=[0], answered=lambda uid: True)
    assert list(probe) == [1]
    assert tracker.silent_nodes(probe, [1], now=10.0) == {}  # once is not enough
    assert tracker.silent_nodes(probe, [1], now=12.0) == {}
    assert tracker.silent_nodes(probe, [1], now=13.0) == {"n1": 10.0}


def test_an_answer_or_an_accepted_connection_resets_the_silence() -> None:
    tracker = SilenceTracker(silent_s=3.0)
    pods = {1: pod(1)}
    tracker.silent_nodes(pods, [1], now=0.0)
    tracker.silent_nodes(pods, [], now=2.0)  # connections accepted: slow, not gone
    assert tracker.silent_nodes(pods, [1], now=4.0) == {}
    tracker.heard(pods.values())
    assert tracker.silent_nodes(pods, [1], now=6.0) == {}


def test_pods_that_never_answered_or_that_the_api_shows_failing_are_not_probed() -> None:
    answered = {"u1", "u2", "u3"}.__contains__
    assert suspects({0: pod(0)}, answering=[], answered=answered) == {}  # still starting
    shown = {1: pod(1, ready=False), 2: pod(2, deleting=True), 3: pod(3, phase="Failed")}
    assert suspects(shown, answering=[], answered=answered) == {}
    tracker = SilenceTracker()
    tracker.silent_nodes({1: pod(1)}, [1], now=0.0)
    tracker.keep_only([pod(4)])  # replaced pods have new uids
    assert tracker.silent_since == {}


def test_a_presumed_node_reads_not_ready_and_its_ranks_fail_as_node_lost() -> None:
    cache = ClusterCache()
    cache.update_job({"metadata": {"namespace": "ns", "name": "j", "uid": "x"}}, False)
    cache.update_node({"metadata": {"name": "n1"}, "status": {"conditions": [
        {"type": "Ready", "status": "True"}]}}, False)
    since = datetime(2026, 12, 2, tzinfo=UTC)
    cache.presume_lost("n1", since, seconds=60)
    snap = cache.snapshot(("ns", "j"))
    assert snap is not None
    node = snap.nodes["n1"]
    assert not node.ready and node.presumed_lost and node.ready_changed_at == since
    failures = detect_failures({1: pod(1)}, snap.nodes, 2, frozenset({1}))
    assert [f.reason for f in failures] == [FailureReason.NODE_LOST]
    assert "does not answer" in failures[0].detail
    cache.presume_lost("n1", since, seconds=-1)  # expired
    assert cache.snapshot(("ns", "j")).nodes["n1"].ready  # type: ignore[union-attr]


def test_refusing_names_the_ranks_whose_every_port_refuses() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        targets = {0: [("127.0.0.1", down), ("127.0.0.1", up)], 1: [("127.0.0.1", down)]}
        assert refusing(targets, timeout=1.0) == {1}


class _Presuming(ClusterCache):
    """The cache, noting the nodes presumed lost."""

    def __init__(self) -> None:
        super().__init__()
        self.presumed: list[str] = []

    def presume_lost(self, node: str, since: datetime, seconds: float) -> None:
        self.presumed.append(node)
        super().presume_lost(node, since, seconds)


class _Listed(WorkerCalls):
    """Calls to workers whose pods are `pods`, whatever the API would list."""

    def __init__(self, ports: RenderConfig, pods: dict[int, PodView]) -> None:
        super().__init__(None, ports, JobTokens(None, None))  # type: ignore[arg-type]
        self._pods = pods

    def listed(self, job: JobView, attempt: int) -> dict[int, PodView]:
        return self._pods


def test_a_survivor_lost_while_a_recovery_waits_is_presumed_lost_at_the_next_probe() -> None:
    """A recovery in Fetching (rank 1 replaced) waits; of the pods it keeps, rank 0's sidecar
    still accepts connections and rank 2's pod refuses both ports (its node went since the
    plan): rank 2's node is presumed lost, once a second at most, never the replacement's."""
    with socket.socket() as sidecar, socket.socket() as gone:
        sidecar.bind(("127.0.0.1", 0))
        sidecar.listen()
        gone.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        ports = replace(CONFIG.render, sidecar_port=sidecar.getsockname()[1] - 1,  # API: +1
                        launcher_port=gone.getsockname()[1])
        cache = _Presuming()
        pods = {0: pod(0, ip="127.0.0.1"), 1: pod(1, uid="new", ip="127.0.0.3"),
                2: pod(2, ip="127.0.0.2")}
        executor = RecoveryExecutor(None, replace(CONFIG, render=ports),  # type: ignore[arg-type]
                                    _Listed(ports, pods), lambda: datetime.now(UTC), cache)
        cache.heard_from(["u0", "u2"])
        record = RecoveryRecord.from_dict(RECOVERY_DOC)  # Fetching, rank 1 replaced
        job, status = JobView("probed", "ns", "uid", 1, {}), JobStatus.from_dict({})
        executor._look_for_lost_survivors(job, status, record)
        assert cache.presumed == ["n2"]
        executor._look_for_lost_survivors(job, status, record)  # within the second: no probe
        assert cache.presumed == ["n2"]
        planning = RecoveryRecord.from_dict({**RECOVERY_DOC, "phase": "Planning"})
        executor._look_for_lost_survivors(JobView("other", "ns", "u", 1, {}), status, planning)
        assert cache.presumed == ["n2"]  # Planning probes the silent ones itself
