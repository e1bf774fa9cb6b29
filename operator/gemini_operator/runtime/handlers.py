"""The one module that registers kopf handlers; it only translates between kopf and the runtime.

Watch events (GeminiJobs, worker pods, nodes, queued jobs' Kueue Workloads) update the cache
and queue the jobs they concern; startup applies every operator setting and starts the work
queue and the leader election; cleanup stops them. No decisions here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from gemini_operator.calls.hints import HintServer
from gemini_operator.calls.poller import POLL_SECONDS, PollRounds
from gemini_operator.cluster.cache import ClusterCache, JobKey
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import naming, queueing
from gemini_operator.runtime.election import LeaderElector
from gemini_operator.runtime.health import Health
from gemini_operator.runtime.metrics import OperatorMetrics
from gemini_operator.runtime.reconciler import Reconciler
from gemini_operator.runtime.workqueue import WorkQueue

log = logging.getLogger(__name__)
ELECTION_PERIOD_SECONDS = 2.0
RESYNC_SECONDS = 60.0


@dataclass
class Runtime:
    """Everything the handlers drive, built before kopf starts."""

    kube: KubeClient
    cache: ClusterCache
    reconciler: Reconciler
    queue: WorkQueue
    elector: LeaderElector
    metrics: OperatorMetrics
    leading: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Where launchers' failure hints are served ((host, port); None: no hint server).
    hint_bind: tuple[str, int] | None = None
    hint_server: HintServer | None = None
    rounds: PollRounds | None = None
    health: Health = field(default_factory=Health)  # /healthz and /readyz

    def queue_all(self) -> None:
        for key in self.cache.job_keys():
            self.queue.add(key)

    def queue_keys(self, keys: list[JobKey]) -> None:
        for key in keys:
            self.queue.add(key)


def register(registry: kopf.OperatorRegistry, runtime: Runtime) -> None:
    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        _configure(settings)
        runtime.tasks = [asyncio.create_task(runtime.health.heartbeat())]
        runtime.queue.start()
        _poll_rounds(runtime)
        if runtime.hint_bind is not None:
            runtime.hint_server = _hint_server(runtime)
            await runtime.hint_server.start(*runtime.hint_bind)
        loops = {"election": _elect(runtime), "resync": _resync(runtime),
                 "poll": _poll(runtime)}
        for name, loop in loops.items():
            runtime.tasks.append(asyncio.create_task(loop))
            runtime.health.watch(name, runtime.tasks[-1])
        for i, worker in enumerate(runtime.queue.workers()):
            runtime.health.watch(f"queue worker {i}", worker)
        runtime.health.started()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in runtime.tasks:
            task.cancel()
        await asyncio.gather(*runtime.tasks, return_exceptions=True)
        if runtime.hint_server is not None:
            await runtime.hint_server.stop()
        await runtime.queue.stop()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        conn = runtime.kube.connection()
        return kopf.ConnectionInfo(
            server=conn.server, ca_path=conn.ca_path, certificate_path=conn.certificate_path,
            private_key_path=conn.private_key_path, token=conn.token, insecure=conn.insecure,
        )

    # Coroutines, not plain functions: kopf runs those in threads, and the work queue (an
    # asyncio.Queue) is not thread-safe: an add from a thread may wait for the loop's next
    # wake-up (seen: events of 1000 pods took minutes to reach the reconciler).
    @kopf.on.event(naming.GROUP, naming.VERSION, naming.PLURAL, registry=registry)
    async def job_event(event: kopf.RawEvent, **_: Any) -> None:
        runtime.queue_keys(runtime.cache.update_job(event["object"], _deleted(event)))

    @kopf.on.event("", "v1", "pods", labels={naming.LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def pod_event(event: kopf.RawEvent, **_: Any) -> None:
        runtime.queue_keys(runtime.cache.update_pod(event["object"], _deleted(event)))

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_event(event: kopf.RawEvent, **_: Any) -> None:
        runtime.queue_keys(runtime.cache.update_node(event["object"], _deleted(event)))

    # A queued job's Kueue Workload (queueing.py): its admission or eviction reconciles the
    # job at once. kopf starts this watch when Kueue's CRDs appear, even after start-up.
    @kopf.on.event(queueing.GROUP, queueing.VERSION, queueing.WORKLOADS,
                   labels={naming.LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def workload_event(event: kopf.RawEvent, **_: Any) -> None:
        runtime.queue_keys(runtime.cache.update_workload(event["object"], _deleted(event)))


class _WithoutKueue(logging.Filter):
    """Drops kopf's start-up warning that Kueue's Workloads cannot be watched: without Kueue
    installed that is expected (the watch starts if its CRDs appear later)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Unresolved resources") and queueing.GROUP in message
                    and message.count("Selector(") == 1)


def _configure(settings: kopf.OperatorSettings) -> None:
    """All kopf settings, in one place."""
    logging.getLogger("kopf._core.reactor.observation").addFilter(_WithoutKueue())
    settings.persistence.finalizer = f"{naming.GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=naming.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # Our own Lease election decides who acts; kopf's peering would need its own CRDs.
    settings.peering.standalone = True


def _deleted(event: kopf.RawEvent) -> bool:
    return event.get("type") == "DELETED"


async def _elect(runtime: Runtime) -> None:
    """Renew or wait for the Lease; on becoming leader, reconcile every job once."""
    while True:
        leads = await asyncio.to_thread(runtime.elector.tick)
        if leads and not runtime.leading:
            log.info("became the leader (%s)", runtime.elector.identity)
            runtime.leading = True
            runtime.queue_all()
        elif not leads and runtime.leading:
            log.warning("lost the leadership (%s)", runtime.elector.identity)
            runtime.leading = False
            runtime.metrics.forget_all()  # the new leader exports the jobs' series
        runtime.metrics.leader.set(1 if leads else 0)
        await asyncio.sleep(ELECTION_PERIOD_SECONDS)


async def _poll(runtime: Runtime) -> None:
    """Every few seconds, ask the running jobs' sidecars and launchers how far they are
    (checkpoint status, hang detection, persistence), every job side by side (a slow job
    waits only for itself); reconcile a job when that changed."""
    rounds = _poll_rounds(runtime)
    try:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            if runtime.leading:
                rounds.start(runtime.cache.job_keys())
    finally:
        rounds.close()
        runtime.rounds = None  # a later start makes a new one


def _poll_rounds(runtime: Runtime) -> PollRounds:
    """The runtime's one PollRounds, shared by the poll loop and the hint server."""
    if runtime.rounds is None:
        runtime.rounds = PollRounds(runtime.reconciler.poller.poll, runtime.queue.add,
                                    observe=runtime.reconciler.metrics.poll_seconds.observe)
    return runtime.rounds


def _hint_server(runtime: Runtime) -> HintServer:
    """Launchers' failure hints start a poll of their job at once (gemini_operator.calls.hints)."""
    def job_uid(key: JobKey) -> str | None:
        job = runtime.cache.stored_job(key)
        return None if job is None else (job.get("metadata") or {}).get("uid")

    def poll_now(key: JobKey) -> None:
        _poll_rounds(runtime).start([key], again=True)

    return HintServer(job_uid, runtime.reconciler.poller.tokens.job_token, poll_now,
                      lambda: runtime.leading,
                      observe=lambda result: runtime.metrics.hints.labels(result).inc(),
                      refused=runtime.metrics.connections_refused.labels("hints"))


async def _resync(runtime: Runtime) -> None:
    """A slow level-based safety net: reconcile every job now and then, events or not."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        runtime.queue_all()
