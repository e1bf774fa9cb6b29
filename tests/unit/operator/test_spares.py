"""Spare placeholder pods: their manifests, the reconcile decisions that keep them, the
replacement's preference for their nodes, and the PriorityClasses that make preemption work."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gemini_operator.cluster.cache import ClusterCache
from gemini_operator.core import naming, render
from gemini_operator.core.decide import decide
from gemini_operator.core.node_affinity import avoiding_nodes, preferring_nodes
from gemini_operator.core.observed import NodeView
from gemini_operator.core.spares import (
    GRACE_SECONDS,
    HoldSpares,
    SpareView,
    ensure_priority_classes,
    priority_classes,
    spare_nodes,
    spare_pod,
    spare_view,
)
from gemini_operator.core.spec import parse_spec
from gemini_operator.core.types import JobView, Observed
from tests.unit.operator.builders import make_job
from tests.unit.operator.test_decide import CONFIG, Harness

JOB = render.JobRef("train", "ns", "uid-1")
RESOURCED = (make_job("train").set("failurePolicy.spareNodes", 2)
             .set("template.resourcesPerNode", {"requests": {"cpu": "2", "memory": "4Gi"},
                                         "limits": {"memory": "4Gi"}})
             .set("checkpoint.sidecar", {"image": "side:1", "resources": {
                 "requests": {"cpu": "500m", "memory": "1Gi"}}}))


def _spec(builder: Any = RESOURCED) -> Any:
    return parse_spec(builder.spec(), "gemini:side")


class SpareHarness(Harness):
    """The reconcile harness plus the placeholder pods the cache would show."""

    def __init__(self, spares: int = 1, **kw: Any) -> None:
        super().__init__(make_job().set("failurePolicy.spareNodes", spares))
        self.spares: dict[int, SpareView] = {}
        self.nodes["n4"] = NodeView("n4", True, zone="b")

    def step(self) -> Any:
        observed = Observed(
            job=JobView.from_object(self.job), pods=dict(self.pods), nodes=self.nodes,
            has_service=self.has_children, has_secret=self.has_children, now=self.now,
            has_network_policy=self.has_children,
            pending_creates=self.pending, spares=dict(self.spares),
        )
        decision = decide(observed, CONFIG)
        self.job["status"] = decision.status.to_dict()
        return decision

    def hold(self, index: int = 0, node: str = "n4", phase: str = "Running", **kw: Any) -> None:
        self.spares[index] = SpareView(naming.spare_pod_name("train", index), index,
                                       f"s{index}", phase, node_name=node,
                                       ready=phase == "Running", owner_uid="uid-1", **kw)


def _hold(decision: Any) -> HoldSpares | None:
    found = [a for a in decision.actions if isinstance(a, HoldSpares)]
    assert len(found) <= 1
    return found[0] if found else None


def _held(decision: Any) -> HoldSpares:
    hold = _hold(decision)
    assert hold is not None, decision.actions
    return hold


def _running_job(spares: int = 1) -> SpareHarness:
    h = SpareHarness(spares)
    h.step()
    h.run_pods()
    h.deliver()
    return h


# --- the placeholder pod --------------------------------------------------------------------

def test_a_placeholder_asks_for_what_a_worker_asks_for_and_only_sleeps():
    spec = _spec()
    config = render.RenderConfig()
    pod = spare_pod(JOB, spec, 1, config)
    worker = render.worker_pod(JOB, spec, 0, 0, config)
    assert pod["metadata"]["name"] == "train-spare-1"
    assert pod["metadata"]["labels"] == {
        naming.LABEL_JOB: "train", naming.LABEL_ROLE: naming.ROLE_SPARE,
        naming.LABEL_SPARE_INDEX: "1", naming.LABEL_MANAGED_BY: naming.MANAGER}
    assert pod["metadata"]["ownerReferences"] == worker["metadata"]["ownerReferences"]
    assert pod["spec"]["affinity"] == worker["spec"]["affinity"]
    (hold,), (hold_sidecar,) = pod["spec"]["containers"], pod["spec"]["initContainers"]
    (trainer,), (sidecar,) = worker["spec"]["containers"], worker["spec"]["initContainers"]
    # Same images (pulled onto the spare node ahead of need) and the same requests, counted
    # by the scheduler the same way (a native sidecar plus a container).
    assert (hold["image"], hold["resources"]) == (trainer["image"], trainer["resources"])
    assert (hold_sidecar["image"], hold_sidecar["resources"]) == (sidecar["image"],
                                                                  sidecar["resources"])
    assert hold_sidecar["restartPolicy"] == sidecar["restartPolicy"] == "Always"
    assert hold["command"] == hold_sidecar["command"] == ["sleep", "infinity"]
    assert pod["spec"]["priorityClassName"] == "gemini-spare"
    assert worker["spec"]["priorityClassName"] == "gemini-worker"
    assert pod["spec"]["terminationGracePeriodSeconds"] == GRACE_SECONDS
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert "volumes" not in pod["spec"]


def test_the_priority_classes_are_configurable_or_left_out():
    config = render.RenderConfig(worker_priority_class="", spare_priority_class="low")
    assert "priorityClassName" not in render.worker_pod(JOB, _spec(), 0, 0, config)["spec"]
    assert spare_pod(JOB, _spec(), 0, config)["spec"]["priorityClassName"] == "low"


def test_spare_view_reads_placeholders_only():
    pod = spare_pod(JOB, _spec(), 0, render.RenderConfig())
    pod["metadata"]["uid"] = "s0"
    pod["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available"}]}
    view = spare_view(pod)
    assert view == SpareView("train-spare-0", 0, "s0", "Pending", owner_uid="uid-1",
                             unschedulable="0/4 nodes are available")
    assert spare_view(render.worker_pod(JOB, _spec(), 0, 0, render.RenderConfig())) is None


# --- reconcile ------------------------------------------------------------------------------

def test_placeholders_are_made_only_once_every_worker_has_a_node():
    h = SpareHarness(spares=2)
    assert _hold(h.step()) is None  # workers are being created
    h.run_pods(phase="Pending", ready=False)
    h.pods[3] = replace(h.pods[3], node_name="")
    assert _hold(h.step()) is None
    assert h.status()["spares"]["reason"] == "Creating"
    h.run_pods(phase="Pending", ready=False)
    d = h.step()
    hold = _hold(d)
    assert hold is not None
    assert [m["metadata"]["name"] for m in hold.create] == ["train-spare-0", "train-spare-1"]
    assert "SparesCreated" in {e.reason for e in d.events}
    assert h.status()["spares"] == {"desired": 2, "ready": 0, "nodes": [],
                                    "reason": "Creating",
                                    "message": "0 of 2 spare nodes held; starting"}


def test_a_running_placeholder_holds_its_node_once_with_an_event():
    h = _running_job()
    h.hold(0, "n4")
    d = h.step()
    assert _hold(d) is None
    assert h.status()["spares"]["nodes"] == ["n4"] and h.status()["spares"]["ready"] == 1
    assert [e.reason for e in d.events if e.reason.startswith("Spares")] == ["SparesHeld"]
    assert not [e for e in h.step().events if e.reason.startswith("Spares")]


def test_a_preempted_placeholder_is_made_again_and_its_wait_reported():
    h = _running_job()
    h.hold(0, "n4")
    h.step()
    h.hold(0, "n4", deleting=True)  # the scheduler preempts it: graceful deletion
    d = h.step()
    assert _hold(d) is None  # its name is still taken
    assert h.status()["spares"]["ready"] == 0
    del h.spares[0]
    (create,) = _held(h.step()).create
    assert create["metadata"]["name"] == "train-spare-0"
    h.hold(0, "", phase="Pending", unschedulable="0/5 nodes are available: 4 node(s) didn't "
           "match pod anti-affinity rules")
    d = h.step()
    spares = h.status()["spares"]
    assert spares["reason"] == "NoFreeNode" and spares["ready"] == 0
    assert "train-spare-0 waits for a free node: 0/5 nodes" in spares["message"]
    (event,) = [e for e in d.events if e.reason == "SparesUnschedulable"]
    assert event.warning
    assert not [e for e in h.step().events if e.reason == "SparesUnschedulable"]


def test_placeholders_are_kept_during_a_recovery():
    h = _running_job()
    h.pods[1] = replace(h.pods[1], phase="Failed")
    d = h.step()
    assert h.condition("Recovering")["status"] == "True"
    assert [m["metadata"]["name"] for m in _held(d).create] == ["train-spare-0"]


def test_suspending_finishing_or_breaking_the_job_removes_the_placeholders():
    for change in ({"suspend": True}, {"numNodes": -1}):
        h = _running_job()
        h.hold(0, "n4")
        h.job["spec"].update(change)
        hold = _hold(h.step())
        assert hold is not None and hold.delete == ("train-spare-0",) and not hold.create
    h = _running_job()
    h.hold(0, "n4")
    for rank in h.pods:
        h.pods[rank] = replace(h.pods[rank], phase="Succeeded")
    hold = _hold(h.step())
    assert h.status()["state"] == "Succeeded"
    assert hold is not None and hold.delete == ("train-spare-0",)


def test_fewer_spares_delete_the_highest_indices_and_lost_or_failed_ones_are_replaced():
    h = _running_job(spares=3)
    h.hold(0, "n4")
    h.hold(1, "n5")
    h.hold(2, "", phase="Failed")
    h.nodes["n5"] = NodeView("n5", False)
    hold = _hold(h.step())
    assert hold is not None
    assert hold.force_delete == ("train-spare-1",) and hold.delete == ("train-spare-2",)
    h.job["spec"]["failurePolicy"]["spareNodes"] = 1
    del h.spares[1], h.spares[2]
    h.hold(1, "n6")
    hold = _hold(h.step())
    assert hold is not None and hold.delete == ("train-spare-1",) and not hold.create
    assert h.status()["spares"]["desired"] == 1


def test_a_placeholder_made_again_stays_off_lost_nodes():
    # The scheduler may place a pod on a lost node until its taint lands: a placeholder made
    # again there was deleted and made again in a loop through the recovery.
    h = _running_job(spares=1)
    h.nodes["n5"] = NodeView("n5", False)
    (made,) = _held(h.step()).create
    (term,) = made["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["n5"]}]
    assert "podAntiAffinity" in made["spec"]["affinity"]


def test_a_job_without_spares_has_no_spare_status():
    h = _running_job(spares=0)
    assert _hold(h.step()) is None
    assert "spares" not in h.status()


# --- replacements go to spare nodes first ---------------------------------------------------

def test_a_replacement_prefers_spare_nodes_and_stays_off_lost_ones():
    nodes = {"n1": NodeView("n1", True), "n2": NodeView("n2", False), "n3": NodeView("n3", True)}
    spares = {0: SpareView("s-0", 0, "a", "Running", "n1", ready=True),
              1: SpareView("s-1", 1, "b", "Running", "n2", ready=True),  # node lost
              2: SpareView("s-2", 2, "c", "Pending")}
    assert spare_nodes(spares, nodes) == ["n1"]
    worker = render.worker_pod(JOB, _spec(), 1, 0, render.RenderConfig())
    pod = preferring_nodes(avoiding_nodes(worker, ["n2"]), ["n1", "n3"])
    affinity = pod["spec"]["affinity"]
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"] == [{"matchFields": [
            {"key": "metadata.name", "operator": "NotIn", "values": ["n2"]}]}]
    assert [t["preference"]["matchFields"][0]["values"] for t in affinity["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]] == [["n1"], ["n3"]]
    assert "podAntiAffinity" in affinity
    assert preferring_nodes({"spec": {}}, []) == {"spec": {}}


# --- priority classes -----------------------------------------------------------------------

def test_workers_outrank_placeholders_which_never_preempt():
    worker, spare = priority_classes(render.RenderConfig())
    assert (worker["metadata"]["name"], spare["metadata"]["name"]) == ("gemini-worker",
                                                                       "gemini-spare")
    assert worker["value"] > 0 > spare["value"]  # placeholders are the first victims
    assert spare["preemptionPolicy"] == "Never"
    assert worker["preemptionPolicy"] == "PreemptLowerPriority"
    assert not worker["globalDefault"] and not spare["globalDefault"]


def test_only_missing_priority_classes_are_created():
    existing = {"gemini-worker"}
    seen = []

    def create(manifest: dict[str, Any]) -> bool:
        seen.append(manifest["metadata"]["name"])
        return manifest["metadata"]["name"] not in existing

    assert ensure_priority_classes(create, render.RenderConfig()) == ["gemini-spare"]
    assert seen == ["gemini-worker", "gemini-spare"]
    assert ensure_priority_classes(create, render.RenderConfig(
        worker_priority_class="", spare_priority_class="")) == []


def test_the_operator_command_takes_the_priority_class_flags():
    from gemini_cli import build_parser

    args = build_parser().parse_args(["operator", "run", "--no-create-priority-classes",
                                      "--worker-priority-class", "w", "--spare-priority-class",
                                      "s"])
    assert (args.create_priority_classes, args.worker_priority_class,
            args.spare_priority_class) == (False, "w", "s")
    args = build_parser().parse_args(["operator", "run"])
    assert args.create_priority_classes is True


# --- the cache ------------------------------------------------------------------------------

def test_the_cache_keeps_placeholders_apart_from_workers():
    cache = ClusterCache()
    cache.update_job({"metadata": {"name": "train", "namespace": "ns", "uid": "uid-1"}}, False)
    pod = spare_pod(JOB, _spec(), 0, render.RenderConfig())
    pod["metadata"]["uid"] = "s0"
    pod["spec"]["nodeName"] = "n4"
    assert cache.update_pod(pod, deleted=False) == [("ns", "train")]
    snap = cache.snapshot(("ns", "train"))
    assert snap is not None and not snap.pods and snap.spares[0].node_name == "n4"
    node: dict[str, Any] = {"metadata": {"name": "n4"}, "status": {"conditions": [
        {"type": "Ready", "status": "True"}]}}
    cache.update_node(node, deleted=False)
    node["status"]["conditions"][0]["status"] = "False"
    assert cache.update_node(node, deleted=False) == [("ns", "train")]
    stale = {**pod, "metadata": {**pod["metadata"], "uid": "older"}}
    cache.update_pod(stale, deleted=True)  # a deletion of an earlier pod of that name
    assert 0 in cache.snapshot(("ns", "train")).spares  # type: ignore[union-attr]
    cache.update_pod(pod, deleted=True)
    assert not cache.snapshot(("ns", "train")).spares  # type: ignore[union-attr]
