"""The operator's composition root: the reconciler and everything it works with, each built
once. One `JobTokens` serves the Secrets the reconciler creates, the steps' calls to the
workers, the poller and the hint server; the cache reads jobs through the status store."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from gemini_operator.calls.background import BackgroundCalls
from gemini_operator.calls.poller import CheckpointPoller
from gemini_operator.calls.tokens import JobTokens
from gemini_operator.calls.worker_calls import WorkerCalls
from gemini_operator.cluster.cache import ClusterCache, JobKey
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.cluster.status_store import StatusStore
from gemini_operator.core.types import ReconcileConfig
from gemini_operator.runtime.children import JobChildren
from gemini_operator.runtime.deliveries import PlacementDeliveries
from gemini_operator.runtime.metrics import OperatorMetrics
from gemini_operator.runtime.reconciler import Reconciler
from gemini_operator.runtime.status_writer import StatusSender
from gemini_operator.steps.recovery import RecoveryExecutor
from gemini_operator.steps.start import TrainingStarter
from gemini_operator.steps.suspend import SuspendSaver
from gemini_operator.steps.workloads import Workloads

Clock = Callable[[], datetime]


def build_reconciler(
    kube: KubeClient, cache: ClusterCache, config: ReconcileConfig,
    metrics: OperatorMetrics | None = None, clock: Clock = lambda: datetime.now(UTC), *,
    wake: Callable[[JobKey], None] | None = None,
    recovery: RecoveryExecutor | None = None,
) -> Reconciler:
    """The reconciler of `cache`'s jobs. `wake` queues a job whose background sidecar call
    ended; `recovery` stands in for the recovery steps (tests)."""
    metrics = metrics or OperatorMetrics()
    tokens = JobTokens(kube, config.token_key)
    calls = WorkerCalls(kube, config.render, tokens)
    store = StatusStore(kube, config.status_inline_bytes)
    cache.read_jobs_through(store.full_job)
    # One clock for every time and duration the steps record.
    return Reconciler(
        kube, cache, config, metrics=metrics, clock=clock,
        poller=CheckpointPoller(kube, cache, config, tokens, clock),
        status=StatusSender(kube, cache, store, metrics),
        children=JobChildren(kube, tokens),
        recovery=recovery or RecoveryExecutor(kube, config, calls, clock, cache),
        starter=TrainingStarter(kube, config, calls, clock),
        suspend_saver=SuspendSaver(calls, clock),
        workloads=Workloads(kube),
        deliveries=PlacementDeliveries(tokens, config.render, BackgroundCalls(wake), clock),
    )
