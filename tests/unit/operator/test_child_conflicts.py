"""Whose a job and its children are (issue 45, item 6). A child's name taken by an object the
job does not own: a tenant who can create Secrets, Services, NetworkPolicies or ConfigMaps in
the namespace could plant one ahead of a job (a peer-auth Secret holding a token it knows, a
permissive NetworkPolicy, a rank-detail ConfigMap). Such an object is neither adopted nor
replaced: the job fails naming it, and no pod is made. A job another controller manages
(spec.managedBy) is left alone. The API server is tests/unit/operator/fake_kube.py here."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from gemini_operator.cluster.cache import ClusterCache
from gemini_operator.cluster.kube import NotOwned
from gemini_operator.cluster.status_store import StatusStore
from gemini_operator.core import naming
from gemini_operator.core.types import ReconcileConfig
from gemini_operator.runtime.wiring import build_reconciler
from tests.unit.operator.fake_kube import FakeKube
from tests.unit.operator.test_status_store import big_status, job

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _job() -> dict[str, Any]:
    return {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
            "metadata": {"name": "llm", "namespace": "ns", "uid": "uid-llm", "generation": 1,
                         "resourceVersion": "1"},
            "spec": {"numNodes": 2, "template": {"spec": {"containers": [
                {"name": "trainer", "image": "trainer:1", "command": ["python", "train.py"]}]}}}}


def _planted(kind: str, name: str, owner_uid: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns"}
    if owner_uid is not None:
        meta["ownerReferences"] = [{"apiVersion": naming.API_VERSION, "kind": naming.KIND,
                                    "name": "llm", "uid": owner_uid}]
    return {"kind": kind, "metadata": meta}


def _reconciled(kube: FakeKube) -> Any:
    cache = ClusterCache()
    cache.update_job(copy.deepcopy(kube.jobs[("ns", "llm")]), deleted=False)
    config = ReconcileConfig(default_sidecar_image="gemini-sidecar:1")
    reconciler = build_reconciler(kube, cache, config, clock=lambda: NOW)  # type: ignore[arg-type]
    reconciler.reconcile(("ns", "llm"))
    return kube.jobs[("ns", "llm")].get("status")


@pytest.mark.parametrize(("kind", "name"), [
    ("Secret", naming.secret_name("llm")),
    ("Service", naming.service_name("llm")),
    ("NetworkPolicy", naming.network_policy_name("llm")),
])
@pytest.mark.parametrize("owner", [None, "uid-of-an-older-llm"])
def test_a_planted_child_fails_the_job_naming_it_and_no_pod_is_made(
        kind: str, name: str, owner: str | None) -> None:
    kube = FakeKube(jobs=[_job()])
    kube.objects[(kind, "ns", name)] = _planted(kind, name, owner)
    status = _reconciled(kube)
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert status["state"] == "Failed" and failed["status"] == "True"
    assert f"the {kind} ns/{name} exists and is not this job's" in failed["message"]
    assert "metadata.name" in failed["message"]
    assert not kube.pods
    assert kube.objects[(kind, "ns", name)] == _planted(kind, name, owner)  # left as it was


def test_the_jobs_own_children_are_found_again_and_kept() -> None:
    kube = FakeKube(jobs=[_job()])
    for kind, name in (("Secret", naming.secret_name("llm")),
                       ("Service", naming.service_name("llm"))):
        kube.objects[(kind, "ns", name)] = _planted(kind, name, "uid-llm")
    status = _reconciled(kube)
    assert status["state"] != "Failed"
    assert len(kube.pods) == 2


def test_a_rank_detail_configmap_someone_else_owns_is_not_replaced() -> None:
    kube = FakeKube()
    planted = _planted("ConfigMap", "big-rank-detail", None)
    kube.configmaps[("ns", "big-rank-detail")] = copy.deepcopy(planted)
    store = StatusStore(kube, inline_bytes=0)  # type: ignore[arg-type]
    with pytest.raises(NotOwned, match="ConfigMap ns/big-rank-detail exists and is not"):
        store.stored_patch(job({}), big_status(16))
    assert kube.configmaps[("ns", "big-rank-detail")] == planted


def test_a_job_managed_by_another_controller_is_left_alone() -> None:
    """Issue 44 (MultiKueue): spec.managedBy other than this operator's: no pod, no status."""
    other = _job()
    other["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    kube = FakeKube(jobs=[other])
    assert _reconciled(kube) in (None, {})  # nothing written
    assert not kube.pods and not kube.objects and kube.writes == 0
    ours = _job()
    ours["spec"]["managedBy"] = naming.CONTROLLER_NAME
    kube = FakeKube(jobs=[ours])
    status = _reconciled(kube)
    assert status["state"] != "Failed" and len(kube.pods) == 2
