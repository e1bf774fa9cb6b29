"""Build the operator's runtime from options and run kopf in this process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

import kopf

from gemini import rank_detail
from gemini.serving.fds import raise_fd_limit
from gemini_operator.cluster.cache import ClusterCache, JobKey
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import spares
from gemini_operator.core.render import RenderConfig
from gemini_operator.core.types import ReconcileConfig
from gemini_operator.runtime import handlers
from gemini_operator.runtime.election import LeaderElector
from gemini_operator.runtime.health import start_metrics_server
from gemini_operator.runtime.metrics import OperatorMetrics
from gemini_operator.runtime.wiring import build_reconciler
from gemini_operator.runtime.workqueue import WorkQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorOptions:
    kubeconfig: str | None = None
    namespace: str | None = None  # None: every namespace
    sidecar_image: str | None = None  # for jobs that name none
    lease_namespace: str = "default"
    lease_name: str = "gemini-operator"
    identity: str = ""  # default: host name, pid and a random suffix
    metrics_port: int | None = None
    # The probes' /healthz and /readyz alone on a listener a flood cannot starve (also served
    # on the metrics port). None: only there.
    health_port: int | None = None
    # Reconcile workers: one namespace runs at most workers - 1 at once (runtime.workqueue), so
    # one is kept for another tenant and a single namespace still has four.
    workers: int = 5
    render: RenderConfig = field(default_factory=RenderConfig)
    # Create the worker and spare PriorityClasses the pods name when missing (needs the right
    # to create PriorityClasses; the Helm chart creates its own and turns this off).
    create_priority_classes: bool = True
    token_key: bytes | None = field(default=None, repr=False)  # tokens.py: None, random ones
    status_inline_bytes: int = rank_detail.DEFAULT_INLINE_BYTES  # gemini.rank_detail
    # Serve launchers' failure hints here ((host, port); gemini_operator.calls.hints); the pods
    # are told `render.hint_url`. None: no hint server (failures wait for the next poll).
    hint_bind: tuple[str, int] | None = None


def default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def build_runtime(options: OperatorOptions) -> handlers.Runtime:
    kube = KubeClient.connect(options.kubeconfig)
    cache = ClusterCache()
    metrics = OperatorMetrics()
    config = ReconcileConfig(render=options.render, default_sidecar_image=options.sidecar_image,
                             token_key=options.token_key,
                             status_inline_bytes=options.status_inline_bytes)
    elector = LeaderElector(kube, options.lease_namespace, options.lease_name,
                            options.identity or default_identity())

    def wake(key: JobKey) -> None:  # the queue, made below, runs the reconciler it wakes
        queue.add_threadsafe(key)

    reconciler = build_reconciler(kube, cache, config, metrics, wake=wake)
    queue = WorkQueue(reconciler.reconcile, elector.leads, metrics, workers=options.workers)
    return handlers.Runtime(kube, cache, reconciler, queue, elector, metrics,
                            hint_bind=options.hint_bind)


async def run_operator(
    options: OperatorOptions,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    runtime: handlers.Runtime | None = None,
) -> None:
    """Run until `stop_flag` is set (or the process is signalled); `runtime` is built from
    the options unless given (tests look into it)."""
    runtime = runtime or build_runtime(options)
    if options.create_priority_classes:
        created = await asyncio.to_thread(spares.ensure_priority_classes,
                                          runtime.kube.create_priority_class, options.render)
        if created:
            log.info("created PriorityClasses %s", ", ".join(created))
    log.info("file descriptor limit: %d", raise_fd_limit())
    if options.metrics_port is not None or options.health_port is not None:
        # /metrics, and the probes' /healthz and /readyz (gemini_operator.runtime.health)
        start_metrics_server(options.metrics_port, runtime.metrics.registry, runtime.health,
                             probe_port=options.health_port,
                             refused=runtime.metrics.connections_refused.labels)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, runtime)
    namespaces = [options.namespace] if options.namespace else []
    await kopf.operator(
        registry=registry, clusterwide=not namespaces, namespaces=namespaces, standalone=True,
        stop_flag=stop_flag, ready_flag=ready_flag,
    )


def run(options: OperatorOptions) -> None:
    asyncio.run(run_operator(options))
