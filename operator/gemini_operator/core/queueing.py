"""Admission by Kueue (kueue.x-k8s.io), as Kueue's own job integrations do it, in pure code.

A GeminiJob labelled `kueue.x-k8s.io/queue-name: <LocalQueue>` is held suspended until Kueue
admits its Workload: the operator creates one Workload per job (owned by it, so it goes with
the job), whose pod sets are the worker pods (and the spare placeholders) with their
requests: Kueue counts the whole job as one workload and admits all of it or nothing. Once
admitted, the flavors' node labels and tolerations go onto every worker pod, replacements
included: a recovery creates pods of an admitted job and never waits on the queue. When
Kueue evicts the workload (preemption, deactivation) the job is suspended (the checkpoint in
memory is saved first, as for any suspend) and, once its pods are gone, the quota is handed
back so that Kueue can queue it again. A finished job marks its Workload Finished, which
frees the quota for the next job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gemini_operator.core import conditions as cond
from gemini_operator.core import naming, render
from gemini_operator.core.quantity import QuantityError, parse_quantity
from gemini_operator.core.spec import JobSpec

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's own priority for the job (a WorkloadPriorityClass), apart from the pods' priority.
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# v1beta2's spec.priorityClassRef of each kind (v1beta1's priorityClassName and
# priorityClassSource are pruned by the v1beta2 schema).
WORKLOAD_PRIORITY_CLASS = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass"}
POD_PRIORITY_CLASS = {"group": "scheduling.k8s.io", "kind": "PriorityClass"}
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS, FLAVORS = "workloads", "resourceflavors"
WORKERS, SPARES = "workers", "spares"  # the pod sets
# What a pod set's template keeps of a rendered pod: what Kueue counts and matches flavors by.
_POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "overhead",
               "runtimeClassName", "schedulerName")
_CONTAINER_FIELDS = ("name", "image", "resources", "restartPolicy")
# Seconds between looks at a waiting job's Workload, should its watch (handlers.py) miss one.
POLL_SECONDS = 5.0

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Flavor:
    """What a ResourceFlavor puts on the pods it admits."""

    node_labels: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Shape:
    """What a Workload asks Kueue for, beyond the pod templates (which change only while the
    job is suspended, when it has no Workload): compared to tell a Workload made for an
    older version of the job."""

    queue: str
    priority_class: str
    counts: tuple[tuple[str, int], ...]  # (pod set, pods)
    # Each pod set's containers' resources, quantities exact: what Kueue charges the quota.
    resources: tuple[tuple[str, str], ...] = ()  # (pod set, canonical text)

    def differences(self, wanted: Shape) -> list[str]:
        pairs = (("LocalQueue", self.queue, wanted.queue),
                 ("priority class", self.priority_class, wanted.priority_class),
                 ("pod sets", _counts_text(self.counts), _counts_text(wanted.counts)))
        found = [f"{what} {old!r} -> {new!r}" for what, old, new in pairs if old != new]
        if self.resources != wanted.resources:
            found.append("the pods' resources differ from the job's")
        return found


def shape_of(workload_spec: Mapping[str, Any]) -> Shape:
    pod_sets = workload_spec.get("podSets") or ()
    return Shape(str(workload_spec.get("queueName") or ""),
                 str((workload_spec.get("priorityClassRef") or {}).get("name") or ""),
                 tuple((str(p.get("name")), int(p.get("count", 1))) for p in pod_sets),
                 tuple((str(p.get("name")), _resources_text(p)) for p in pod_sets))


def _resources_text(pod_set: Mapping[str, Any]) -> str:
    """A pod set's containers' requests and limits, each quantity by its exact value (the
    API may write "1000m" as "1"); unreadable quantities as given (they differ, then)."""
    spec = (pod_set.get("template") or {}).get("spec") or {}
    parts = []
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or ():
            resources = container.get("resources") or {}
            for which in ("requests", "limits"):
                for name, value in sorted((resources.get(which) or {}).items()):
                    parts.append(f"{kind}/{container.get('name')}/{which}/{name}="
                                 f"{_exact(value)}")
    return ";".join(parts)


def _exact(value: Any) -> str:
    try:
        return str(parse_quantity(value).normalize())
    except (QuantityError, TypeError, AttributeError):
        return repr(value)


def _counts_text(counts: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{name}: {count}" for name, count in counts)


@dataclass(frozen=True)
class WorkloadView:
    name: str
    resource_version: str
    owner_uid: str
    admitted: bool
    quota_reserved: bool
    finished: bool
    pods_ready: bool
    evicted: str | None  # the Evicted condition's message while it is true
    flavors: tuple[str, ...]  # the flavors assigned to the workers, when admitted
    conditions: tuple[Mapping[str, Any], ...] = ()
    # The assigned flavors' node labels and tolerations (read by the reconciler).
    placement: Flavor = field(default_factory=Flavor)
    shape: Shape = field(default_factory=lambda: Shape("", "", ()))  # what it was made for
    admitted_counts: Mapping[str, int] = field(default_factory=dict)  # pods by pod set

    def with_placement(self, flavors: Sequence[Flavor]) -> WorkloadView:
        labels: dict[str, str] = {}
        tolerations: list[Mapping[str, Any]] = []
        for flavor in flavors:
            labels.update(flavor.node_labels)
            tolerations.extend(t for t in flavor.tolerations if t not in tolerations)
        return replace(self, placement=Flavor(labels, tuple(tolerations)))


def queue_name(labels: Mapping[str, str]) -> str | None:
    name = labels.get(QUEUE_LABEL)
    return name or None


def was_queued(status: Mapping[str, Any] | None) -> bool:
    """Whether the job's status says it waited for or was admitted by Kueue: taken off its
    queue, it may still have a Workload to delete (read it even without the label, should
    the Workloads' watch not have told)."""
    found = next((c for c in (status or {}).get("conditions") or ()
                  if c.get("type") == cond.ConditionType.SUSPENDED.value), None)
    return found is not None and found.get("reason") in (cond.JOB_QUEUED.reason,
                                                          cond.JOB_ADMITTED.reason)


def workload_name(job: render.JobRef) -> str:
    """One Workload per job; the uid's start keeps a recreated job from finding the old one's."""
    return f"geminijob-{job.name}-{job.uid[:8]}"


def workload_view(obj: Mapping[str, Any]) -> WorkloadView:
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    conditions = tuple(status.get("conditions") or ())
    true = {c.get("type"): c for c in conditions if c.get("status") == "True"}
    owners = [o for o in meta.get("ownerReferences") or () if o.get("controller")]
    assignments = (status.get("admission") or {}).get("podSetAssignments") or ()
    flavors = sorted({str(f) for a in assignments if a.get("name") == WORKERS
                      for f in (a.get("flavors") or {}).values()})
    evicted = true.get("Evicted")
    counts = {str(a.get("name")): int(a["count"]) for a in assignments
              if a.get("count") is not None}
    return WorkloadView(
        name=str(meta.get("name", "")), resource_version=str(meta.get("resourceVersion", "")),
        owner_uid=str(owners[0].get("uid", "")) if owners else "",
        admitted="Admitted" in true, quota_reserved="QuotaReserved" in true,
        finished="Finished" in true, pods_ready="PodsReady" in true,
        evicted=str(evicted.get("message") or evicted.get("reason") or "evicted")
        if evicted else None,
        flavors=tuple(flavors), conditions=conditions,
        shape=shape_of(obj.get("spec") or {}), admitted_counts=counts)


def flavor_of(obj: Mapping[str, Any]) -> Flavor:
    spec = obj.get("spec") or {}
    return Flavor(dict(spec.get("nodeLabels") or {}), tuple(spec.get("tolerations") or ()))


def holds(queue: str | None, workload: WorkloadView | None) -> str | None:
    """Why the queue keeps the job from running, or None when it may run."""
    if queue is None:
        return None
    if workload is None:
        return f"waiting for its Kueue Workload in LocalQueue {queue!r} to be created"
    if workload.finished:
        return None  # the job has finished; nothing to hold
    if workload.evicted is not None:
        return f"evicted by Kueue ({workload.evicted}); it waits in LocalQueue {queue!r} again"
    if not workload.admitted:
        return (f"waiting for Kueue to admit Workload {workload.name} in LocalQueue "
                f"{queue!r}")
    return None


def admitted_spec(spec: JobSpec, workload: WorkloadView | None) -> JobSpec:
    """`spec` with the admitted flavors' node labels and tolerations on its pods, and no
    more spare placeholders than were admitted (spareNodes raised after the admission waits
    for the next one: the quota counted only those)."""
    if workload is None or not workload.admitted:
        return spec
    asked = dict(workload.shape.counts)
    admitted_spares = workload.admitted_counts.get(SPARES, asked.get(SPARES, 0))
    if spec.failure_policy.spare_nodes > admitted_spares:
        spec = replace(spec, failure_policy=replace(spec.failure_policy,
                                                    spare_nodes=admitted_spares))
    placed = workload.placement
    if not placed.node_labels and not placed.tolerations:
        return spec
    pod = dict(spec.template.parts.pod)
    pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **placed.node_labels}
    own = list(pod.get("tolerations") or ())
    pod["tolerations"] = own + [t for t in placed.tolerations if t not in own]
    parts = replace(spec.template.parts, pod=pod)
    return replace(spec, template=replace(spec.template, parts=parts))


def workload_manifest(job: render.JobRef, labels: Mapping[str, str], worker: Manifest,
                      workers: int, spare: Manifest | None, spares: int) -> Manifest:
    """The Workload of a job: its worker pods (and spare placeholders) as pod sets, its
    priority class named (the executor fills in the class's value: Kueue reads no class)."""
    pod_sets = [_pod_set(WORKERS, worker, workers)]
    if spare is not None and spares:
        pod_sets.append(_pod_set(SPARES, spare, spares))
    spec: Manifest = {"queueName": labels[QUEUE_LABEL], "podSets": pod_sets}
    if labels.get(PRIORITY_LABEL):
        spec["priorityClassRef"] = {**WORKLOAD_PRIORITY_CLASS, "name": labels[PRIORITY_LABEL]}
    elif worker["spec"].get("priorityClassName"):
        spec["priorityClassRef"] = {**POD_PRIORITY_CLASS,
                                    "name": worker["spec"]["priorityClassName"]}
    return {
        "apiVersion": API_VERSION, "kind": "Workload",
        "metadata": {"name": workload_name(job), "namespace": job.namespace,
                     "labels": {naming.LABEL_JOB: job.name},
                     "ownerReferences": [render.owner_reference(job)]},
        "spec": spec,
    }


def _pod_set(name: str, pod: Manifest, count: int) -> Manifest:
    spec = pod["spec"]
    kept: Manifest = {k: spec[k] for k in _POD_FIELDS if k in spec}
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            kept[kind] = [{k: c[k] for k in _CONTAINER_FIELDS if k in c} for c in spec[kind]]
    return {"name": name, "count": count, "template": {"spec": kept}}


def finished_patch(workload: WorkloadView, succeeded: bool, message: str, now: str
                   ) -> Manifest:
    """The status patch that tells Kueue the job is done (its quota is freed)."""
    finished = {"type": "Finished", "status": "True",
                "reason": "Succeeded" if succeeded else "Failed",
                "message": message[:1024], "lastTransitionTime": now}
    return _conditions_patch(workload, [finished])


def pods_ready_patch(workload: WorkloadView, ready: bool, message: str, now: str
                     ) -> Manifest:
    """The status patch that tells Kueue whether every worker is ready (Kueue's
    waitForPodsReady evicts a workload whose pods are not all ready in time)."""
    return _conditions_patch(workload, [{
        "type": "PodsReady", "status": "True" if ready else "False",
        "reason": "PodsReady" if ready else "PodsNotReady", "message": message[:1024],
        "lastTransitionTime": now}])


def release_patch(workload: WorkloadView, now: str) -> Manifest:
    """The status patch that hands an evicted workload's quota back once the job's pods are
    gone, so that Kueue queues it again (what Kueue's job integrations do)."""
    why = f"the job's pods are gone after the eviction: {workload.evicted}"[:1024]
    released = [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                 "message": why, "lastTransitionTime": now},
                {"type": "Admitted", "status": "False", "reason": "NoReservation",
                 "message": "the workload has no quota reservation", "lastTransitionTime": now}]
    patch = _conditions_patch(workload, released)
    patch["status"]["admission"] = None
    return patch


def _conditions_patch(workload: WorkloadView, new: Sequence[Manifest]) -> Manifest:
    """A merge patch of the whole conditions list, valid only for the version it was read
    at (a conflict means Kueue wrote since: decide again on fresh data)."""
    replaced = {c["type"] for c in new}
    kept = [dict(c) for c in workload.conditions if c.get("type") not in replaced]
    by_type = {c.get("type"): c for c in workload.conditions}
    for condition in new:
        old = by_type.get(condition["type"])
        if old is not None and old.get("status") == condition["status"]:
            condition = {**condition, "lastTransitionTime": old.get("lastTransitionTime")}
        kept.append(dict(condition))
    return {"metadata": {"resourceVersion": workload.resource_version},
            "status": {"conditions": kept}}
