"""The live /metrics endpoints, scraped over HTTP as Prometheus would, count a real recovery.

One GeminiJob (examples/train_fsdp.py on 2 workers, tiny model, S3 persistence) on the local
cluster; one trainer crash. Scraped: the operator's endpoint (served from its registry the way
`gemini operator run --metrics-port` does, with its /healthz and /readyz) and every sidecar's
(pod IP, the `sidecar-api` port of the pod spec, as pod discovery finds it) and every
launcher's (the trainer container's `launcher` port). Every per-job series names the job by
`geminijob_namespace` and `geminijob`.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from gemini_local import faults
from gemini_operator.runtime.health import start_metrics_server
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import newest_step
from tests.fixtures.operator import OperatorThread
from tests.fixtures.s3 import S3Server, create_credentials_secret, persistence_spec
from tests.unit.operator.builders import make_job
from tests.unit.packaging.test_dashboard import metric_names, queries

# ./dev long: CI's proof of live scrapes counting recoveries is the kubelet S3 case's real
# Prometheus (test_kubelet_nodes.py, with every dashboard panel and an alert).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.s3, pytest.mark.long,
              pytest.mark.proves("live-metrics")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_fsdp.py"
# Long enough after the restart for the sidecars to be scraped while training goes on.
ARGS = ["--steps", "40", "--layers", "1", "--d-model", "32", "--step-sleep", "0.4"]
ENV = [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
NAME = "metered"


@dataclass(frozen=True)
class Scrape:
    """One scrape: sample name -> [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    @classmethod
    def of(cls, url: str) -> Scrape:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return cls(samples)

    def value(self, name: str, absent: float | None = None, **labels: str) -> float:
        """The sum over the series of `name` carrying `labels`. No such series fails (a
        renamed or unexported metric must not read as 0), unless `absent` says what it means
        (a labelled counter before its first increment)."""
        found = [v for have, v in self.samples.get(name, [])
                 if all(have.get(k) == want for k, want in labels.items())]
        if not found:
            assert absent is not None, f"no series {name}{labels or ''} in the scrape"
            return absent
        return sum(found)

    def names(self) -> set[str]:
        return set(self.samples)


def dashboard_metrics() -> set[str]:
    return {name for _, expr in queries() for name in metric_names(expr)}


@pytest.fixture
def operator_metrics_url(gemini_operator: OperatorThread) -> Iterator[str]:
    """The in-process operator's registry served over HTTP, as main.py serves it."""
    runtime = gemini_operator.runtime
    server = start_metrics_server(0, runtime.metrics.registry, runtime.health,
                                  addr="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.port}/metrics"
    finally:
        server.stop()


def sidecar_urls(jobs: Jobs, port: str = "sidecar-api") -> dict[str, str]:
    """pod name -> the metrics URL of its container port `port` (the sidecar's or the
    launcher's), from the pod's IP and declared port."""
    urls = {}
    for pod in jobs.pods(NAME):
        containers = [*(pod.spec.init_containers or []), *(pod.spec.containers or [])]
        ports = [p for c in containers for p in c.ports or [] if p.name == port]
        assert len(ports) == 1 and pod.status.pod_ip, pod
        urls[pod.metadata.name] = f"http://{pod.status.pod_ip}:{ports[0].container_port}/metrics"
    return urls


def metered_job(s3: S3Server, prefix: str) -> dict[str, Any]:
    endpoint = s3.endpoint
    return (make_job(NAME).with_nodes(2).with_replicas(2)
            .set("template.command", ["python", str(SCRIPT), *ARGS])
            .set("template.env", ENV)
            .set("persistence", persistence_spec(endpoint, prefix, 30))
            .obj())


def test_live_scrapes_count_one_recovery_and_cover_the_dashboard(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, s3_server: S3Server, s3_prefix: str, operator_metrics_url: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    create_credentials_secret(jobs.core, job_namespace, s3_server.endpoint)
    jobs.create(metered_job(s3_server, s3_prefix))
    state = local_cluster.state_dir
    wait_for(lambda: newest_step(state, job_namespace, f"{NAME}-worker-0") >= 4, 300,
             "training to reach step 4")
    wait_for(lambda: jobs.get(NAME)["status"].get("checkpoint", {}).get("persistedStep"), 120,
             "a step persisted to S3")
    urls = sidecar_urls(jobs)
    assert len(urls) == 2
    # Every sidecar holds its peer's shard (2 workers, 2 copies) before the crash.
    wait_for(lambda: all(Scrape.of(u).value("gemini_replicas_complete") == 1
                         for u in urls.values()), 60, "each sidecar to hold a complete replica")
    operator_before = Scrape.of(operator_metrics_url)
    sidecars_before = {pod: Scrape.of(url) for pod, url in urls.items()}
    launch_epoch = jobs.get(NAME)["status"]["launch"]["epoch"]

    faults.kill_container(state, job_namespace, f"{NAME}-worker-1", "trainer")
    killed_at = time.monotonic()

    def recovered() -> Any:
        last = ((jobs.get(NAME) or {}).get("status") or {}).get("lastRecovery")
        return last if last and last["epoch"] > launch_epoch else None

    last = wait_for(recovered, 180, "the recovery to finish")
    print(f"recovered in {time.monotonic() - killed_at:.1f} s: {last}")
    assert (last["cause"], last["source"]) == ("software", "Local"), last
    # The counters move when the finishing reconcile returns; its status write is seen first.
    wait_for(lambda: Scrape.of(operator_metrics_url).value(
        "gemini_operator_recovery_seconds_count", absent=0.0) > operator_before.value(
        "gemini_operator_recovery_seconds_count", absent=0.0), 30, "the recovery to be counted")
    operator_after = Scrape.of(operator_metrics_url)
    # Both sidecars keep serving (only a trainer died) and see training go on after it.
    restored = int(last["restoredStep"])
    wait_for(lambda: all(Scrape.of(u).value("gemini_local_version") >= restored + 3
                         for u in urls.values()), 180, "training to go on after the restart")
    sidecars_after = {pod: Scrape.of(url) for pod, url in urls.items()}
    # Every launcher (the crashed rank's is a new one: its container restarted) runs the
    # recovery's epoch, and reports how long its process took to its first heartbeat.
    launchers = {pod: Scrape.of(url) for pod, url in sidecar_urls(jobs, "launcher").items()}
    assert len(launchers) == 2
    for pod, scrape in launchers.items():
        assert scrape.value("gemini_launcher_epoch") == last["epoch"], pod
        assert scrape.value("gemini_launcher_training_running") == 1, pod
        assert scrape.value("gemini_launcher_restarts_total") >= 1, pod
        assert scrape.value("gemini_launcher_start_seconds") >= 0, pod
        assert scrape.value("gemini_launcher_progress_step") > restored, pod

    def delta(name: str, **labels: str) -> float:
        """Its change over the recovery: present after it, maybe not before (this session's
        first recovery of that kind)."""
        return operator_after.value(name, **labels) - operator_before.value(
            name, absent=0.0, **labels)

    assert delta("gemini_operator_recoveries_total", kind="software") == 1
    assert delta("gemini_operator_recoveries_total") == 1
    assert delta("gemini_operator_failures_detected_total") == 1
    assert delta("gemini_operator_recoveries_finished_total",
                 cause="software", source="Local") == 1
    assert delta("gemini_operator_recoveries_finished_total") == 1
    assert delta("gemini_operator_recovery_seconds_count") == 1
    assert delta("gemini_operator_recovery_seconds_sum") == pytest.approx(
        last["durationSeconds"], abs=1e-6)
    assert delta("gemini_operator_recovery_downtime_seconds_total") == pytest.approx(
        last["durationSeconds"], abs=1e-6)
    assert delta("gemini_operator_steps_lost_total") == last["stepsLost"]
    for phase in last["breakdown"]:
        assert delta("gemini_operator_recovery_phase_seconds_count", phase=phase) == 1, phase
    job = {"geminijob_namespace": job_namespace, "geminijob": NAME}
    persisted = operator_after.value("gemini_operator_persisted_checkpoint_timestamp_seconds",
                                     **job)
    assert time.time() - 600 < persisted <= time.time()
    assert operator_after.value("gemini_operator_persist_interval_seconds", **job) == 30
    states = [labels["state"] for labels, _ in operator_after.samples["gemini_operator_job_state"]
              if labels.items() >= job.items()]
    assert len(states) == 1, states  # one series per job: its status.state
    assert operator_after.value("gemini_operator_build_info") == 1
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(operator_metrics_url.replace("/metrics", path),
                                    timeout=10) as answer:
            assert answer.status == 200, path
    # Every gemini_* series of the job's pods names its job and rank, never a target label.
    for pod, scrape in [*sidecars_after.items(), *launchers.items()]:
        assert scrape.value("process_resident_memory_bytes") > 0, pod
        for name, series in scrape.samples.items():
            for labels, _ in series:
                if name.startswith("gemini_"):
                    assert labels.items() >= job.items() and "rank" in labels, (pod, name)
                assert not labels.keys() & {"job", "namespace", "pod"}, (pod, name)

    for pod, after in sidecars_after.items():
        before = sidecars_before[pod]
        print(f"{pod}: " + ", ".join(
            f"{n} {before.value(n):g} -> {after.value(n):g}" for n in (
                "gemini_snapshot_stall_seconds_count", "gemini_replication_bytes_total",
                "gemini_local_version", "gemini_s3_persist_seconds_count")))
        assert after.value("gemini_snapshot_stall_seconds_count") > before.value(
            "gemini_snapshot_stall_seconds_count"), pod
        assert after.value("gemini_replication_bytes_total") > before.value(
            "gemini_replication_bytes_total") > 0, pod
        assert after.value("gemini_replication_seconds_count") > before.value(
            "gemini_replication_seconds_count"), pod
        assert after.value("gemini_local_version") > before.value("gemini_local_version"), pod
        assert after.value("gemini_replicas_held") == 1, pod
        assert after.value("gemini_replicas_complete") == 1, pod
        assert after.value("gemini_memory_used_bytes") > 0, pod
        assert after.value("gemini_memory_budget_bytes") >= after.value(
            "gemini_memory_used_bytes"), pod
        assert before.value("gemini_s3_persist_seconds_count") >= 1, pod
        assert after.value("gemini_s3_failures_total") == 0, pod
        assert after.value("gemini_peer_refused_total") == 0, pod

    seen = operator_after.names().union(*(s.names() for s in sidecars_after.values()),
                                        *(s.names() for s in launchers.values()))
    missing = dashboard_metrics() - seen
    assert not missing, f"the dashboard queries series no live endpoint exports: {missing}"

    wait_for(lambda: jobs.state(NAME) in ("Succeeded", "Failed"), 300, "the job to finish")
    assert jobs.state(NAME) == "Succeeded", jobs.get(NAME)["status"]
    jobs.delete(NAME)
