"""Prometheus metrics of one sidecar, in their own registry. Every gemini_* series is labelled
with its GeminiJob (`geminijob_namespace`, `geminijob`) and `rank`, never with a scrape's own
target labels (gemini.metric_labels); the process collectors' series carry none of ours (join
them with gemini_sidecar_build_info on the target labels)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from gemini.metric_labels import JOB, JOB_NAMESPACE, RANK, build_labels

_STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True)
class SidecarMetrics:
    registry: CollectorRegistry
    snapshot_stall: Histogram
    replication_bytes: Counter
    replication_seconds: Histogram
    replication_lag: Gauge
    replicas_held: Gauge
    replicas_complete: Gauge
    memory_used: Gauge
    memory_budget: Gauge
    budget_refusals: Counter
    refused_frames: Counter
    api_refused: Counter
    accept_errors: Counter
    peer_connections: Gauge
    api_connections: Gauge
    s3_persist_seconds: Histogram
    s3_restore_seconds: Histogram
    s3_failures: Counter
    s3_parts_sent: Counter
    fetch_seconds: Histogram
    fetch_failures: Counter
    latest_local_version: Gauge

    def render(self) -> bytes:
        return generate_latest(self.registry)


def make_metrics(namespace: str, job: str, rank: int) -> SidecarMetrics:
    """The metrics of rank `rank`'s sidecar of GeminiJob `namespace`/`job`."""
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    labels = {JOB_NAMESPACE: namespace, JOB: job, RANK: str(rank)}
    names = list(labels)
    build = {**labels, **build_labels()}
    Gauge("gemini_sidecar_build_info", "1, labelled with the running sidecar's version",
          list(build), registry=reg).labels(**build).set(1)

    def counter(name: str, doc: str) -> Counter:
        return Counter(name, doc, names, registry=reg).labels(**labels)  # type: ignore[return-value]

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, names, registry=reg).labels(**labels)  # type: ignore[return-value]

    def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(name, doc, names, buckets=buckets, registry=reg)
        return metric.labels(**labels)  # type: ignore[return-value]

    return SidecarMetrics(
        registry=reg,
        snapshot_stall=histogram(
            "gemini_snapshot_stall_seconds",
            "Time the training step was blocked copying its shard to shared memory.",
            _STALL_BUCKETS),
        replication_bytes=counter(
            "gemini_replication_bytes_total", "Shard bytes sent to peer sidecars."),
        replication_seconds=histogram(
            "gemini_replication_seconds",
            "Time to send one version of the local shard to one peer.", _TRANSFER_BUCKETS),
        replication_lag=gauge(
            "gemini_replication_lag_steps",
            "Newest local version minus the newest version complete on every peer."),
        replicas_held=gauge("gemini_replicas_held", "Peer ranks whose shards this sidecar holds."),
        replicas_complete=gauge(
            "gemini_replicas_complete", "Held peer ranks with at least one complete version."),
        memory_used=gauge("gemini_memory_used_bytes", "Bytes allocated by the replica store."),
        memory_budget=gauge("gemini_memory_budget_bytes", "Replica store memory budget."),
        budget_refusals=counter(
            "gemini_memory_budget_refusals_total",
            "Replica versions refused because they would exceed the memory budget."),
        refused_frames=counter(
            "gemini_peer_refused_total",
            "Peer connections refused: unauthenticated, another job, malformed or oversized "
            "frames, no handshake in time, over the connection limits."),
        api_refused=counter(
            "gemini_api_refused_total",
            "API connections or calls refused: over the connection limits, without the token."),
        accept_errors=counter(
            "gemini_accept_errors_total",
            "Failed accepts on the peer listener (out of file descriptors, ...); it retries."),
        peer_connections=gauge("gemini_peer_connections", "Open peer protocol connections."),
        api_connections=gauge("gemini_api_connections", "Open HTTP API connections."),
        s3_persist_seconds=histogram(
            "gemini_s3_persist_seconds", "Time to upload one shard version to S3.",
            _TRANSFER_BUCKETS),
        s3_restore_seconds=histogram(
            "gemini_s3_restore_seconds", "Time to download one shard version from S3.",
            _TRANSFER_BUCKETS),
        s3_failures=counter("gemini_s3_failures_total", "Failed S3 uploads or downloads."),
        s3_parts_sent=counter(
            "gemini_s3_parts_sent_total",
            "Parts uploaded to S3 (a resumed upload sends only the parts S3 lacks)."),
        fetch_seconds=histogram(
            "gemini_fetch_seconds", "Time to fetch one shard version from peer holders.",
            _TRANSFER_BUCKETS),
        fetch_failures=counter(
            "gemini_fetch_failures_total",
            "Failed fetch attempts from a holder (unreachable, refused, corrupt chunk)."),
        latest_local_version=gauge(
            "gemini_local_version", "Newest complete version of the local shard."),
    )
