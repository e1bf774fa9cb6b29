"""The operator's poll loop (handlers._poll with the real CheckpointPoller) against two jobs'
workers on loopback: one job's sidecar and launcher drip their answers a byte at a time,
the other's answer at once. The healthy job is polled on time, round after round, while the
slow job's poll is still in flight, and the slow job never has two polls at once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any, cast

import pytest

from gemini.control.launcher import Progress
from gemini_operator.calls import poller
from gemini_operator.cluster.cache import ClusterCache, JobKey
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import naming
from gemini_operator.core.render import RenderConfig
from gemini_operator.core.types import ReconcileConfig
from gemini_operator.runtime import handlers
from gemini_operator.runtime.election import LeaderElector
from gemini_operator.runtime.metrics import OperatorMetrics
from gemini_operator.runtime.wiring import build_reconciler
from gemini_operator.runtime.workqueue import WorkQueue
from tests.integration.control.hostile import Server, drip_body, routes, serving
from tests.unit.control.test_types import INVENTORY, STATUS
from tests.unit.operator.builders import make_job
from tests.unit.operator.fake_kube import FakeKube

pytestmark = pytest.mark.integration

ROUND = 0.5  # seconds between poll rounds here (2 s in the operator)
CALL_DEADLINE = 1.5  # each poll call's deadline here (2 s in the operator)
SLOW, HEALTHY = ("default", "slow"), ("default", "healthy")


@dataclass
class Workers:
    """One job's rank-0 pod IP and the servers on its sidecar API and launcher ports."""

    ip: str
    sidecar: Server
    launcher: Server


@contextmanager
def workers_of_two_jobs() -> Iterator[tuple[Workers, Workers, RenderConfig]]:
    """The slow job's workers on 127.0.0.2, the healthy job's on 127.0.0.3, same ports."""
    with ExitStack() as stack:
        slow_api = stack.enter_context(serving(drip_body(), "127.0.0.2"))
        slow_launcher = stack.enter_context(serving(drip_body(), "127.0.0.2"))
        healthy_api = stack.enter_context(serving(
            routes({"/inventory": json.dumps(INVENTORY.to_json()).encode()}),
            "127.0.0.3", slow_api.port))
        healthy_launcher = stack.enter_context(serving(
            routes({"/status": json.dumps(STATUS.to_json()).encode()}),
            "127.0.0.3", slow_launcher.port))
        ports = RenderConfig(sidecar_port=slow_api.port - 1, launcher_port=slow_launcher.port)
        yield (Workers("127.0.0.2", slow_api, slow_launcher),
               Workers("127.0.0.3", healthy_api, healthy_launcher), ports)


def _running_job(cache: ClusterCache, key: JobKey, ip: str) -> None:
    """A one-rank job whose launchers were told to train, and its running pod at `ip`."""
    namespace, name = key
    job = make_job(name, namespace).with_nodes(1).with_replicas(1).with_uid(f"{name}-uid").obj()
    job["status"] = {"restartAttempt": 0, "launch": {"epoch": 1, "restartAttempt": 0}}
    cache.update_job(job, deleted=False)
    cache.update_pod({
        "metadata": {"name": f"{name}-0", "namespace": namespace, "uid": f"{name}-pod",
                     "labels": {naming.LABEL_JOB: name, naming.LABEL_RANK: "0",
                                naming.LABEL_RESTART_ATTEMPT: "0"},
                     "ownerReferences": [{"controller": True, "uid": f"{name}-uid"}]},
        "spec": {"nodeName": f"node-{name}"},
        "status": {"phase": "Running", "podIP": ip},
    }, deleted=False)


def _runtime(cache: ClusterCache, ports: RenderConfig) -> handlers.Runtime:
    """The operator's runtime as main.build_runtime wires it, leading; only the Kubernetes
    client is a stand-in (its one read here is the token)."""
    tokens = {(namespace, naming.secret_name(name)): {"token": "job-token"}
              for namespace, name in (SLOW, HEALTHY)}
    kube = cast(KubeClient, FakeKube(secrets=tokens))
    config = ReconcileConfig(render=ports, default_sidecar_image="gemini:side")
    metrics = OperatorMetrics()
    reconciler = build_reconciler(kube, cache, config, metrics)
    queue = WorkQueue(reconciler.reconcile, lambda: True, metrics)
    return handlers.Runtime(kube, cache, reconciler, queue, cast(LeaderElector, None), metrics,
                            leading=True)


async def _until(done: Any, limit: float) -> float:
    """Seconds until `done()`, or pytest.fail after `limit`."""
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > limit:
            pytest.fail(f"not within {limit} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_job_whose_workers_drip_does_not_delay_polling_another_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "POLL_SECONDS", ROUND)
    monkeypatch.setattr(poller, "POLL_TIMEOUT_SECONDS", CALL_DEADLINE)
    with workers_of_two_jobs() as (slow, healthy, ports):
        cache = ClusterCache()
        _running_job(cache, SLOW, slow.ip)  # first: a loop over jobs in turn meets it first
        _running_job(cache, HEALTHY, healthy.ip)
        runtime = _runtime(cache, ports)
        polling = asyncio.create_task(handlers._poll(runtime))
        try:
            first = await _until(lambda: runtime.reconciler.poller.findings(HEALTHY), 10)
            # Three more rounds for the healthy job while the slow one's first poll runs on.
            more = await _until(lambda: len(healthy.sidecar.paths) >= 4, 10)
            slow_calls = len(slow.sidecar.paths)
            await _until(lambda: len(slow.sidecar.paths) >= 2, 10)  # polled again, later
        finally:
            polling.cancel()
            await asyncio.gather(polling, return_exceptions=True)
    assert first < ROUND + 0.5, first
    assert first + more < 4 * ROUND + 1.0, more
    assert slow_calls == 1  # the slow job's poll was still in its first call meanwhile
    assert slow.sidecar.most_active == 1 and slow.launcher.most_active == 1
    assert healthy.sidecar.paths[:4] == ["/inventory"] * 4
    assert runtime.reconciler.poller.findings(HEALTHY) is not None


async def test_a_poll_reads_progress_from_the_sidecars_alone_when_they_carry_heartbeats(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One call per pod a poll: the sidecar's inventory carries the trainer's heartbeat, so
    no launcher is called (an inventory without one falls back to the launchers: above)."""
    monkeypatch.setattr(handlers, "POLL_SECONDS", ROUND)
    inventory = replace(INVENTORY, heartbeat=True, progress=Progress(41, time.time() - 0.5, 0.5))
    with ExitStack() as stack:
        api = stack.enter_context(serving(
            routes({"/inventory": json.dumps(inventory.to_json()).encode()}), "127.0.0.4"))
        launcher = stack.enter_context(serving(
            routes({"/status": json.dumps(STATUS.to_json()).encode()}), "127.0.0.4"))
        cache = ClusterCache()
        _running_job(cache, HEALTHY, "127.0.0.4")
        runtime = _runtime(cache, RenderConfig(sidecar_port=api.port - 1,
                                               launcher_port=launcher.port))
        polling = asyncio.create_task(handlers._poll(runtime))
        try:
            await _until(lambda: len(api.paths) >= 3, 10)
        finally:
            polling.cancel()
            await asyncio.gather(polling, return_exceptions=True)
    found = runtime.reconciler.poller.findings(HEALTHY)
    assert found is not None and found.progress is not None
    assert found.progress.step == 41  # the heartbeat the inventory carried (the launcher: 9)
    assert launcher.paths == []
