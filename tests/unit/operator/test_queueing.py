"""Admission by Kueue (queueing.py): a queued job waits suspended for its Workload's
admission, runs on the admitted flavor's nodes, gives its quota back after an eviction and
frees it when it finishes."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from gemini_operator.cluster.cache import ClusterCache
from gemini_operator.core import naming, queueing
from gemini_operator.core.actions import (
    CreatePods,
    CreateWorkload,
    DeletePods,
    DeleteWorkload,
    PatchWorkload,
)
from gemini_operator.core.queueing import Flavor, WorkloadView
from gemini_operator.core.render import JobRef
from gemini_operator.core.spares import HoldSpares
from gemini_operator.core.types import JobView
from gemini_operator.steps.workloads import Workloads
from tests.unit.operator.builders import make_job
from tests.unit.operator.test_decide import Harness, _of

QUEUE = "team-a"


def _workload(spec: dict[str, Any] | None = None, **conditions: str) -> dict[str, Any]:
    """A Workload as Kueue shows it; by default made for _queued()'s job."""
    status: dict[str, Any] = {"conditions": [
        {"type": kind, "status": value, "reason": "R", "message": f"{kind} says so",
         "lastTransitionTime": "2026-12-01T00:00:00Z"} for kind, value in conditions.items()]}
    if conditions.get("QuotaReserved") == "True":
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "workers", "count": 4, "flavors": {"cpu": "gpu-a", "memory": "gpu-a"}}]}
    return {"metadata": {"name": "geminijob-train-uid-1", "resourceVersion": "7",
                         "ownerReferences": [{"uid": "uid-1", "controller": True}]},
            "spec": spec or _made_spec(), "status": status}


def _made_spec() -> dict[str, Any]:
    """The Workload spec the operator makes for _queued()'s job."""
    (create,) = _of(_queued().step(), CreateWorkload)
    return dict(create.manifest["spec"])


def _queued() -> Harness:
    h = Harness(make_job().set("template.spec.containers", [{
        "name": "trainer", "image": "train:1", "command": ["python", "t.py"],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}}]))
    h.job["metadata"]["labels"] = {queueing.QUEUE_LABEL: QUEUE}
    return h


def test_a_queued_job_makes_its_workload_and_waits_suspended_without_pods() -> None:
    h = _queued()
    d = h.step()
    (create,) = _of(d, CreateWorkload)
    assert not _of(d, CreatePods)
    assert h.status()["state"] == "Suspended"
    assert h.condition("Suspended")["reason"] == "WaitingForAdmission"
    assert d.requeue_after == queueing.POLL_SECONDS
    wl = create.manifest
    assert wl["spec"]["queueName"] == QUEUE
    assert wl["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    (workers,) = wl["spec"]["podSets"]
    assert workers["name"] == "workers" and workers["count"] == 4
    trainer = next(c for c in workers["template"]["spec"]["containers"] if c["name"] == "trainer")
    assert trainer["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert "env" not in trainer  # only what Kueue counts and matches flavors by
    # the sidecar is counted too: a native sidecar adds to every worker's requests
    init = workers["template"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == [naming.SIDECAR_CONTAINER]

    h.workload = queueing.workload_view(_workload(QuotaReserved="False"))
    d = h.step()
    assert not _of(d, CreateWorkload) and not _of(d, CreatePods)
    assert "waiting for Kueue to admit Workload" in h.condition("Suspended")["message"]


def test_an_admitted_job_runs_on_the_flavors_nodes_and_keeps_the_users_selector() -> None:
    h = _queued()
    h.job["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "training"}
    h.step()
    view = queueing.workload_view(_workload(QuotaReserved="True", Admitted="True"))
    assert view.admitted and view.flavors == ("gpu-a",)
    h.workload = view.with_placement([Flavor({"gpu": "a100"}, (
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},))])
    d = h.step()
    (create,) = _of(d, CreatePods)
    assert h.condition("Suspended") == {**h.condition("Suspended"), "status": "False",
                                         "reason": "Admitted"}
    for pod in create.manifests:
        assert pod["spec"]["nodeSelector"] == {"pool": "training", "gpu": "a100"}
        assert {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"} in (
            pod["spec"]["tolerations"])
    assert h.status()["restartAttempt"] == 0  # no pods ran before: not a new attempt


def test_an_evicted_job_stops_and_hands_its_quota_back_once_its_pods_are_gone() -> None:
    h = _queued()
    h.step()
    h.workload = queueing.workload_view(_workload(QuotaReserved="True", Admitted="True"))
    h.step()
    h.run_pods()
    h.step()
    h.workload = queueing.workload_view(_workload(QuotaReserved="True", Admitted="True",
                                                  Evicted="True"))
    d = h.step()
    assert len(_of(d, DeletePods)[0].names) == 4 and not _of(d, PatchWorkload)
    assert "evicted by Kueue (Evicted says so)" in h.condition("Suspended")["message"]
    h.pods.clear()
    (release,) = _of(h.step(), PatchWorkload)
    status = release.patch["status"]
    assert status["admission"] is None
    assert release.patch["metadata"]["resourceVersion"] == "7"
    kinds = {c["type"]: c["status"] for c in status["conditions"]}
    assert kinds == {"QuotaReserved": "False", "Admitted": "False", "Evicted": "True"}


def test_kueue_is_told_when_every_worker_is_ready_and_when_that_ends() -> None:
    h = _queued()
    h.workload = queueing.workload_view(_workload(QuotaReserved="True", Admitted="True"))
    assert not _of(h.step(), PatchWorkload)  # pods made, none ready: nothing to say yet
    h.run_pods()
    h.step()
    (ready,) = _of(h.step(), PatchWorkload)
    (cond,) = [c for c in ready.patch["status"]["conditions"] if c["type"] == "PodsReady"]
    assert (cond["status"], cond["message"]) == ("True", "all 4 workers are ready")
    h.workload = replace(h.workload, pods_ready=True)
    assert not _of(h.step(), PatchWorkload)
    h.run_pods(ready=False)
    (lost,) = _of(h.step(), PatchWorkload)
    (cond,) = [c for c in lost.patch["status"]["conditions"] if c["type"] == "PodsReady"]
    assert cond["status"] == "False"


def test_a_finished_job_marks_its_workload_finished_once() -> None:
    h = _queued()
    h.workload = queueing.workload_view(_workload(QuotaReserved="True", Admitted="True"))
    h.step()
    h.run_pods(phase="Succeeded", ready=False)
    h.step()
    assert h.status()["state"] == "Succeeded"
    (finish,) = _of(h.step(), PatchWorkload)
    (done,) = [c for c in finish.patch["status"]["conditions"] if c["type"] == "Finished"]
    assert done["status"] == "True" and done["reason"] == "Succeeded"
    h.workload = replace(h.workload, finished=True)
    assert not _of(h.step(), PatchWorkload)


def test_a_job_the_user_suspends_holds_no_quota_once_its_pods_are_gone() -> None:
    h = _queued()
    h.job["spec"]["suspend"] = True
    d = h.step()
    assert not _of(d, CreatePods) and not _of(d, CreateWorkload)  # nothing queued
    assert h.condition("Suspended")["reason"] == "JobSuspended"
    h.job["spec"]["suspend"] = False
    h.workload = queueing.workload_view(_workload(QuotaReserved="True", Admitted="True"))
    h.step()
    h.run_pods()
    h.job["spec"]["suspend"] = True
    d = h.step()
    assert _of(d, DeletePods) and not _of(d, DeleteWorkload)  # the pods go first
    assert h.condition("Suspended")["reason"] == "JobSuspended"
    h.pods.clear()
    (delete,) = _of(h.step(), DeleteWorkload)
    assert delete.name == h.workload.name


def test_a_job_without_a_queue_label_never_touches_kueue() -> None:
    h = Harness()
    d = h.step()
    assert _of(d, CreatePods) and not _of(d, CreateWorkload)


def test_spares_are_a_pod_set_of_their_own_and_the_priority_class_is_kept() -> None:
    h = _queued()
    h.job["spec"]["failurePolicy"] = {"spareNodes": 2}
    h.job["spec"]["template"]["spec"]["priorityClassName"] = "training-high"
    (create,) = _of(h.step(), CreateWorkload)
    sets = {s["name"]: s for s in create.manifest["spec"]["podSets"]}
    assert sets["spares"]["count"] == 2 and sets["workers"]["count"] == 4
    assert create.manifest["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "training-high"}


def test_kueues_own_priority_class_label_wins_and_its_value_is_filled_in() -> None:
    h = _queued()
    h.job["metadata"]["labels"][queueing.PRIORITY_LABEL] = "urgent"
    (create,) = _of(h.step(), CreateWorkload)
    spec = create.manifest["spec"]
    assert spec["priorityClassRef"] == {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "urgent"}

    class Classes:
        def priority_value(self, name: str, workload_class: bool) -> int | None:
            return 5000 if (name, workload_class) == ("urgent", True) else None

        def create_workload(self, manifest: dict[str, Any]) -> bool:
            self.created = manifest
            return True

    kube = Classes()
    outcome = Workloads(kube).create(JobView.from_object(h.job), create)  # type: ignore[arg-type]
    assert kube.created["spec"]["priority"] == 5000
    assert [e.reason for e in outcome.events] == ["WorkloadCreated"]
    h.job["metadata"]["labels"][queueing.PRIORITY_LABEL] = "missing"
    (create,) = _of(h.step(), CreateWorkload)
    outcome = Workloads(kube).create(JobView.from_object(h.job), create)  # type: ignore[arg-type]
    (event,) = outcome.events
    assert event.reason == "QueueUnavailable" and event.warning
    assert "WorkloadPriorityClass 'missing' does not exist" in event.message


def test_workload_names_differ_for_a_job_recreated_under_the_same_name() -> None:
    first = queueing.workload_name(JobRef("train", "ns", "aaaaaaaa-1"))
    second = queueing.workload_name(JobRef("train", "ns", "bbbbbbbb-2"))
    assert first != second and first.startswith("geminijob-train-")


def test_a_workload_of_another_owner_is_read_but_never_mistaken_for_admission() -> None:
    view = queueing.workload_view({"metadata": {"name": "x"}, "status": {}})
    assert isinstance(view, WorkloadView) and not view.admitted and view.evicted is None
    assert queueing.holds(QUEUE, None) is not None
    assert queueing.holds(None, None) is None


def test_kopfs_warning_about_an_absent_kueue_is_dropped_and_no_other() -> None:
    import logging

    from gemini_operator.runtime.handlers import _WithoutKueue

    def kept(message: str) -> bool:
        return _WithoutKueue().filter(
            logging.LogRecord("kopf", logging.WARNING, "", 0, message, None, None))

    ours = "Selector(group='kueue.x-k8s.io', version='v1beta2', any_name='workloads')"
    other = "Selector(group='gemini.io', version='v1beta1', any_name='geminijobs')"
    prefix = "Unresolved resources cannot be served (try creating their CRDs): "
    assert not kept(prefix + ours)
    assert kept(f"{prefix}{other}, {ours}") and kept(prefix + other)


def test_a_waiting_jobs_workload_is_made_again_when_its_queue_or_spares_change() -> None:
    h = _queued()
    (create,) = _of(h.step(), CreateWorkload)
    h.workload = queueing.workload_view(_workload(create.manifest["spec"]))
    assert not _of(h.step(), DeleteWorkload)  # made for this job: left alone
    h.job["metadata"]["labels"][queueing.QUEUE_LABEL] = "team-b"
    h.job["spec"]["failurePolicy"] = {"spareNodes": 1}
    (delete,) = _of(h.step(), DeleteWorkload)
    assert "LocalQueue 'team-a' -> 'team-b'" in delete.why
    assert "pod sets 'workers: 4' -> 'workers: 4, spares: 1'" in delete.why
    h.workload = None
    (create,) = _of(h.step(), CreateWorkload)
    assert create.manifest["spec"]["queueName"] == "team-b"
    assert h.condition("Suspended")["reason"] == "WaitingForAdmission"


def test_an_admitted_job_keeps_its_admission_and_no_more_spares_than_were_admitted() -> None:
    h = _queued()
    h.job["spec"]["failurePolicy"] = {"spareNodes": 1}
    (create,) = _of(h.step(), CreateWorkload)
    admitted = _workload(create.manifest["spec"], QuotaReserved="True", Admitted="True")
    admitted["status"]["admission"]["podSetAssignments"].append(
        {"name": "spares", "count": 1, "flavors": {"cpu": "gpu-a"}})
    h.workload = queueing.workload_view(admitted)
    h.step()
    h.run_pods()
    h.job["spec"]["failurePolicy"] = {"spareNodes": 3}  # raised while it runs
    d = h.step()
    assert not _of(d, DeleteWorkload) and not _of(d, DeletePods)
    (hold,) = _of(d, HoldSpares)
    assert len(hold.create) == 1  # the admitted one, not three


def test_a_job_taken_off_its_queue_deletes_its_workload_and_runs_unqueued() -> None:
    h = _queued()
    (create,) = _of(h.step(), CreateWorkload)
    h.workload = queueing.workload_view(_workload(create.manifest["spec"]))
    del h.job["metadata"]["labels"][queueing.QUEUE_LABEL]
    d = h.step()
    (delete,) = _of(d, DeleteWorkload)
    assert "label was removed: it runs outside Kueue's quota" in delete.why
    assert _of(d, CreatePods)
    assert h.condition("Suspended")["status"] == "False"
    assert h.condition("Suspended")["reason"] == "LeftQueue"
    assert not queueing.was_queued(h.status())  # its Workload is not looked for any more
    # an admitted, running job keeps its pods and gives its Workload up
    h = _queued()
    h.step()
    h.workload = queueing.workload_view(_workload(QuotaReserved="True", Admitted="True"))
    h.step()
    h.run_pods()
    assert queueing.was_queued(h.status())  # Admitted: read its Workload, label or not
    h.job["metadata"]["labels"].clear()
    d = h.step()
    assert _of(d, DeleteWorkload) and not _of(d, DeletePods)
    assert "the job runs outside Kueue's quota" in h.condition("Suspended")["message"]
    h.workload = None
    d = h.step()
    assert not _of(d, DeleteWorkload) and not queueing.was_queued(h.status())


def test_the_cache_remembers_a_jobs_workloads_from_their_watch() -> None:
    cache = ClusterCache()
    cache.update_job({"metadata": {"name": "train", "namespace": "ns"}}, False)
    wl = {"metadata": {"name": "geminijob-train-1", "namespace": "ns",
                       "labels": {naming.LABEL_JOB: "train"}}}
    assert cache.update_workload(wl, False) == [("ns", "train")]
    assert cache.snapshot(("ns", "train")).has_workload  # type: ignore[union-attr]
    assert cache.update_workload({"metadata": {"name": "other"}}, False) == []
    cache.update_workload(wl, True)
    assert not cache.snapshot(("ns", "train")).has_workload  # type: ignore[union-attr]


def test_an_admission_for_smaller_pods_starts_no_pod_and_the_workload_is_made_again() -> None:
    """Issue 45, item 6: a Workload of the job's name and owner asking for less than its pods
    take (made by anyone who may write Workloads) would let the job run past its quota."""
    h = _queued()
    spec = _made_spec()
    small = json.loads(json.dumps(spec).replace('"memory": "4Gi"', '"memory": "1Mi"'))
    assert small != spec
    h.workload = queueing.workload_view(_workload(small, QuotaReserved="True", Admitted="True"))
    d = h.step()
    assert not _of(d, CreatePods)
    (delete,) = _of(d, DeleteWorkload)
    assert "the pods' resources differ from the job's" in delete.why
    assert "admitted for other pods than the job's" in h.condition("Suspended")["message"]
    # the same quantities written another way are the same admission
    same = json.loads(json.dumps(spec).replace('"memory": "4Gi"', '"memory": "4096Mi"'))
    h.workload = queueing.workload_view(_workload(same, QuotaReserved="True", Admitted="True"))
    d = h.step()
    assert _of(d, CreatePods) and not _of(d, DeleteWorkload)


def test_a_workload_of_the_jobs_name_that_is_not_its_own_fails_the_job() -> None:
    h = _queued()
    planted = _workload(QuotaReserved="True", Admitted="True")
    planted["metadata"]["ownerReferences"] = []  # nobody's: made by hand, not adopted
    h.workload = queueing.workload_view(planted)
    d = h.step()
    assert not _of(d, CreatePods)
    failed = h.condition("Failed")
    assert failed["status"] == "True" and "is not this job's" in failed["message"]
