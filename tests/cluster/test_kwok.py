"""kwok's fake nodes at scale: a pod on each node but ten (1000 of 1010 in `./dev long`, 100 of
110 in CI) goes Running with an IP; a lost node is lost; the operator runs a GeminiJob there
although no sidecar or launcher ever answers."""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from gemini import rank_detail
from gemini_local import kwok
from gemini_local.nodeagent.config import GPU_RESOURCE, RACK_LABEL, ZONE_LABEL
from tests.fixtures.kwok import KWOK_RACKS, KWOK_ZONES, KwokCluster
from tests.fixtures.operator import OperatorThread, configmap_reader

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def core(kwok_cluster: KwokCluster) -> Any:
    """A CoreV1Api; raw JSON (`_preload_content=False`) is read for speed at 1000 pods."""
    return kwok.core_api(kwok_cluster.kubeconfig, pool=16)


@pytest.fixture
def kwok_namespace(core: Any) -> Iterator[str]:
    name = f"kwok-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        # kwok finalizes deleted pods; grace 0 so Terminating ones on lost nodes go too.
        core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
        core.delete_namespace(name)


def _pods(core: Any, namespace: str) -> list[dict[str, Any]]:
    resp = core.list_namespaced_pod(namespace, _preload_content=False)
    return list(json.loads(resp.data)["items"])


def _wait(what: str, predicate: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def _running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(c["type"] == "Ready" and c["status"] == "True"
                for c in status.get("conditions") or [])
    return status.get("phase") == "Running" and bool(status.get("podIP")) and ready


def _worker(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"w-{i}", "labels": {"app": "scale"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "trainer", "image": "none", "resources": {
                "requests": {"cpu": "1", GPU_RESOURCE: "1"},
                "limits": {GPU_RESOURCE: "1"}}}],
            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "scale"}},
                 "topologyKey": "kubernetes.io/hostname"}]}},
        },
    }


def test_fake_nodes_have_topology_and_resources(
    kwok_cluster: KwokCluster, core: Any,
) -> None:
    print(f"\nkwok cluster set-up (s): {kwok_cluster.timings}")
    resp = core.list_node(label_selector=f"{kwok.FAKE_NODE_LABEL}=true", _preload_content=False)
    nodes = json.loads(resp.data)["items"]
    assert len(nodes) == len(kwok_cluster.nodes)
    labels = [n["metadata"]["labels"] for n in nodes]
    assert len({lab[ZONE_LABEL] for lab in labels}) == KWOK_ZONES
    assert len({lab[RACK_LABEL] for lab in labels}) == KWOK_RACKS
    assert all(lab["kubernetes.io/hostname"] == n["metadata"]["name"]
               for lab, n in zip(labels, nodes, strict=True))
    assert all(n["status"]["allocatable"][GPU_RESOURCE] == "8" for n in nodes)
    assert len({n["status"]["addresses"][0]["address"] for n in nodes}) == len(nodes)


def test_a_pod_on_each_node_but_ten_runs_with_an_ip(
    kwok_cluster: KwokCluster, core: Any, kwok_namespace: str,
) -> None:
    pods_wanted = len(kwok_cluster.nodes) - 10
    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: core.create_namespaced_pod(
            kwok_namespace, _worker(i), _preload_content=False), range(pods_wanted)))
    created = time.monotonic() - start
    _wait(f"{pods_wanted} pods Running with an IP",
          lambda: sum(_running(p) for p in _pods(core, kwok_namespace)) == pods_wanted, timeout=300)
    running = time.monotonic() - start
    print(f"\n{pods_wanted} pods: created in {created:.1f}s, all Running in {running:.1f}s")

    pods = _pods(core, kwok_namespace)
    nodes = Counter(p["spec"]["nodeName"] for p in pods)
    assert len(nodes) == pods_wanted, "anti-affinity: at most one worker per node"
    assert set(nodes) <= {n.name for n in kwok_cluster.nodes}
    ips = {ipaddress.ip_address(p["status"]["podIP"]) for p in pods}
    assert len(ips) == pods_wanted, "pod IPs are unique"
    assert all(ip in ipaddress.ip_network(kwok.POD_CIDR) for ip in ips)
    zone_of = {n.name: n.zone for n in kwok_cluster.nodes}
    zones = Counter(zone_of[p["spec"]["nodeName"]] for p in pods)
    assert len(zones) == KWOK_ZONES and min(zones.values()) > pods_wanted // KWOK_ZONES // 2


def test_lost_node_turns_unknown_evicts_and_comes_back(
    kwok_cluster: KwokCluster, core: Any, kwok_namespace: str,
) -> None:
    node = kwok_cluster.nodes[-1].name
    pinned = {"metadata": {"name": "pinned"}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "c", "image": "none"}]}}
    core.create_namespaced_pod(kwok_namespace, pinned)
    _wait("pinned pod Running", lambda: _running(_read_pod(core, kwok_namespace, "pinned")), 60)

    kwok.kwok_lose_node(kwok_cluster.kubeconfig, node)
    status = _node(core, node)
    assert _ready(status) == "Unknown"
    assert {("node.kubernetes.io/unreachable", "NoSchedule"),
            ("node.kubernetes.io/unreachable", "NoExecute")} <= _taints(status)
    # KCM's taint eviction deletes the pod after its 5 s toleration; with no kubelet to confirm,
    # it stays Terminating.
    _wait("pod on the lost node evicted", lambda: _read_pod(
        core, kwok_namespace, "pinned")["metadata"].get("deletionTimestamp") is not None, 30)
    time.sleep(2)
    assert _read_pod(core, kwok_namespace, "pinned")["metadata"]["name"] == "pinned"
    # Nothing new lands on it.
    core.create_namespaced_pod(kwok_namespace, {**pinned, "metadata": {"name": "pinned-2"}})
    time.sleep(3)
    assert not _read_pod(core, kwok_namespace, "pinned-2")["spec"].get("nodeName")
    assert _ready(_node(core, node)) == "Unknown", "kwok must not revive a lost node"

    kwok.kwok_restore_node(kwok_cluster.kubeconfig, node)
    _wait("restored node Ready and untainted", lambda: _ready(_node(core, node)) == "True"
          and not _taints(_node(core, node)), 30)
    _wait("Terminating pod finalized", lambda: "pinned" not in {
        p["metadata"]["name"] for p in _pods(core, kwok_namespace)}, 30)
    _wait("pending pod placed on the restored node",
          lambda: _running(_read_pod(core, kwok_namespace, "pinned-2")), 60)


def _read_pod(core: Any, namespace: str, name: str) -> dict[str, Any]:
    resp = core.read_namespaced_pod(name, namespace, _preload_content=False)
    return dict(json.loads(resp.data))


def _node(core: Any, name: str) -> dict[str, Any]:
    return dict(json.loads(core.read_node(name, _preload_content=False).data))


def _ready(node: dict[str, Any]) -> str:
    return next((c["status"] for c in node["status"].get("conditions") or []
                 if c["type"] == "Ready"), "None")


def _taints(node: dict[str, Any]) -> set[tuple[str, str]]:
    return {(t["key"], t["effect"]) for t in node["spec"].get("taints") or []}


JOB_RANKS, JOB_LOST = 40, 3
GROUP, VERSION, PLURAL = "gemini.io", "v1beta1", "geminijobs"


def _job(name: str, ranks: int) -> dict[str, Any]:
    # Nothing runs on fake nodes: image and command only have to be valid.
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GeminiJob", "metadata": {"name": name},
        "spec": {
            "numNodes": ranks,
            "template": {"image": "gemini:test", "command": ["python", "-m", "train"],
                         "resourcesPerNode": {"requests": {"cpu": "4", GPU_RESOURCE: "8"},
                                              "limits": {GPU_RESOURCE: "8"}}},
            "checkpoint": {"replicas": 2},
            "failurePolicy": {"maxRestarts": 10},
        },
    }


def test_placement_is_published_and_lost_ranks_replaced_without_any_sidecar(
    kwok_cluster: KwokCluster, kwok_operator: OperatorThread, core: Any, kwok_namespace: str,
) -> None:
    from kubernetes import client, config

    custom = client.CustomObjectsApi(config.new_client_from_config(str(kwok_cluster.kubeconfig)))
    custom.create_namespaced_custom_object(GROUP, VERSION, kwok_namespace, PLURAL,
                                           _job("fake", JOB_RANKS))

    def status() -> dict[str, Any]:
        """The full status: the per-rank maps joined in from the job's rank-detail ConfigMap
        (the test operator keeps them there, gemini.rank_detail)."""
        raw: Any = custom.get_namespaced_custom_object(
            GROUP, VERSION, kwok_namespace, PLURAL, "fake", _preload_content=False)
        return rank_detail.resolve(json.loads(raw.data).get("status") or {},
                                   configmap_reader(core, kwok_namespace))

    def condition(kind: str) -> dict[str, Any]:
        return next((c for c in status().get("conditions") or [] if c["type"] == kind), {})

    took = _wait("placement published and every worker ready", lambda: (
        len((status().get("placement") or {}).get("nodes") or {}) == JOB_RANKS
        and (status().get("workers") or {}).get("ready") == JOB_RANKS), 120)
    # Published although no sidecar took it: delivery has a condition of its own, retried.
    _wait("delivery failure recorded", lambda: condition("PlacementDelivered").get(
        "reason") == "SidecarsUnreachable", 30)
    assert f"{JOB_RANKS} of {JOB_RANKS} sidecars" in condition("PlacementDelivered")["message"]
    assert "launch" not in status(), "training must not start before the sidecars have peers"
    print(f"\n{JOB_RANKS}-rank job on fake nodes: placement and status in {took:.1f}s")

    pods = {p["metadata"]["labels"]["gemini.io/rank"]: p for p in _pods(core, kwok_namespace)
            if "gemini.io/rank" in p["metadata"]["labels"]}
    victims = [pods[str(r)] for r in range(0, JOB_RANKS, JOB_RANKS // JOB_LOST)][:JOB_LOST]
    lost_nodes = {p["spec"]["nodeName"] for p in victims}
    lost_ranks = {p["metadata"]["labels"]["gemini.io/rank"] for p in victims}
    old_uids = {p["metadata"]["uid"] for p in pods.values()}
    try:
        start = time.monotonic()
        for node in lost_nodes:
            kwok.kwok_lose_node(kwok_cluster.kubeconfig, node)

        def replacements() -> list[dict[str, Any]]:
            return [p for p in _pods(core, kwok_namespace)
                    if p["metadata"]["uid"] not in old_uids
                    and not p["metadata"].get("deletionTimestamp")]

        _wait("replacement pods for the lost ranks", lambda: {
            p["metadata"]["labels"]["gemini.io/rank"] for p in replacements()} == lost_ranks, 60)
        replaced = time.monotonic() - start
        _wait("the recovery recorded", lambda: set(map(str, (status().get("lastRecovery") or {})
                                                     .get("failedRanks") or [])) >= lost_ranks, 60)
        print(f"{JOB_LOST} lost ranks: replacement pods created {replaced:.1f}s after the loss")
        fresh = replacements()
        assert {p["metadata"]["labels"]["gemini.io/rank"] for p in fresh} == lost_ranks, \
            "only the lost ranks get new pods"
        assert not {p["spec"].get("nodeName") for p in fresh} & lost_nodes
        metric = kwok_operator.runtime.metrics.registry.get_sample_value
        assert metric("gemini_operator_failure_detection_seconds_count", {"cause": "NodeLost"})
        assert metric("gemini_operator_failure_detection_seconds_sum", {"cause": "NodeLost"}) < 60
    finally:
        for node in lost_nodes:
            kwok.kwok_restore_node(kwok_cluster.kubeconfig, node)
        custom.delete_namespaced_custom_object(GROUP, VERSION, kwok_namespace, PLURAL, "fake")
