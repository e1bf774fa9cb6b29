"""Spare nodes held by placeholder pods (spec.failurePolicy.spareNodes), so that a replacement
worker never waits for a node to free up.

A placeholder `<job>-spare-<i>` asks for what a worker asks for (a container with the trainer's
image and resources, a native sidecar with the sidecar's), runs only a sleep, and carries the
workers' one-pod-per-node anti-affinity and a low PriorityClass that never preempts anything.
Workers carry a higher class: when a replacement finds no free node, the kube-scheduler preempts
a placeholder (a graceful deletion) and binds the replacement to its node, whose images the
placeholder has already pulled. The operator then makes the placeholder again; with no free
node it stays Pending, and status.spares and an event say so.

Pure: views in, manifests, status and events out; reconciler.py executes `HoldSpares`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gemini_operator.core import naming
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.node_affinity import avoiding_nodes
from gemini_operator.core.observed import NodeView, condition_true, controller_uid
from gemini_operator.core.pod_template import merged
from gemini_operator.core.records import SparesRecord
from gemini_operator.core.render import (
    JobRef,
    RenderConfig,
    container_security_context,
    one_pod_per_node,
    owner_reference,
    pod_security_context,
    trainer_security_context,
)
from gemini_operator.core.spec import JobSpec

Manifest = dict[str, Any]

# The classes the operator creates when missing (the Helm chart creates its own, configurable).
# Workers at 1000 preempt placeholders (and pods without a class, priority 0, when no node has a
# placeholder). Placeholders sit below 0 so that a preempting replacement picks them as victims
# before anyone else's pods; they never preempt.
WORKER_PRIORITY = 1000
SPARE_PRIORITY = -10
HOLD_CONTAINER = "hold"
HOLD_SIDECAR = "hold-sidecar"
# A placeholder saves nothing: a short grace lets the preempting worker in quickly. (The
# sleep may be PID 1 in a real container, which ignores SIGTERM: the kubelet kills it then.)
GRACE_SECONDS = 1
MESSAGE_LIMIT = 1024


@dataclass(frozen=True)
class SpareView:
    """A placeholder pod as observed."""

    name: str
    index: int
    uid: str
    phase: str
    node_name: str = ""
    ready: bool = False
    deleting: bool = False
    owner_uid: str = ""
    unschedulable: str = ""  # the scheduler's message while it finds no node, else ""

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class HoldSpares:
    """Create the missing placeholders, delete unwanted or finished ones, and force-delete
    those on lost nodes (nothing there will ever confirm a graceful deletion)."""

    create: tuple[Manifest, ...] = ()
    delete: tuple[str, ...] = ()
    force_delete: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpareDecision:
    action: HoldSpares | None
    status: SparesRecord | None  # None when the job holds no spares
    events: tuple[Event, ...] = ()


def spare_view(pod: Mapping[str, Any]) -> SpareView | None:
    """The view of a placeholder pod; None for any other pod."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(naming.LABEL_ROLE) != naming.ROLE_SPARE:
        return None
    try:
        index = int(labels[naming.LABEL_SPARE_INDEX])
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    conditions = {str(c.get("type")): c for c in status.get("conditions") or ()}
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = str(scheduled.get("message") or "no node fits")
    return SpareView(
        name=str(meta.get("name", "")),
        index=index,
        uid=str(meta.get("uid", "")),
        phase=str(status.get("phase") or "Pending"),
        node_name=str((pod.get("spec") or {}).get("nodeName") or ""),
        ready=condition_true(status, "Ready"),
        deleting=meta.get("deletionTimestamp") is not None,
        owner_uid=controller_uid(meta),
        unschedulable=unschedulable,
    )


def spare_labels(job: str, index: int) -> dict[str, str]:
    return {
        naming.LABEL_JOB: job,
        naming.LABEL_ROLE: naming.ROLE_SPARE,
        naming.LABEL_SPARE_INDEX: str(index),
        naming.LABEL_MANAGED_BY: naming.MANAGER,
    }


def spare_pod(job: JobRef, spec: JobSpec, index: int, config: RenderConfig) -> Manifest:
    """Placeholder `index`: a worker's requests, images and anti-affinity, doing nothing."""
    template, sidecar = spec.template, spec.checkpoint.sidecar
    hold: Manifest = {
        "name": HOLD_CONTAINER,
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": list(config.spare_command),
        "securityContext": trainer_security_context(template),  # the trainer image's user
    }
    hold_sidecar: Manifest = {
        "name": HOLD_SIDECAR,
        "image": sidecar.image,
        "imagePullPolicy": sidecar.image_pull_policy,
        "command": list(config.spare_command),
        "restartPolicy": "Always",  # a native sidecar, counted as the worker's sidecar is
        "securityContext": container_security_context(),
    }
    for container, resources in ((hold, template.resources), (hold_sidecar, sidecar.resources)):
        if resources.to_manifest():
            container["resources"] = resources.to_manifest()
    pod_spec: Manifest = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        # As hardened as a worker: a namespace that admits the workers admits these too.
        "securityContext": pod_security_context(template.run_as),
        "affinity": one_pod_per_node(job.name),
        "initContainers": [hold_sidecar],
        "containers": [hold],
    }
    if config.spare_priority_class:
        pod_spec["priorityClassName"] = config.spare_priority_class
    # Where a worker may run (selectors, tolerations, affinity, priority) goes for it too.
    return merged({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": naming.spare_pod_name(job.name, index),
            "namespace": job.namespace,
            "labels": spare_labels(job.name, index),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": pod_spec,
    }, template.parts, scheduling_only=True)


def decide_spares(
    job: JobRef, spec: JobSpec, config: RenderConfig, spares: Mapping[int, SpareView],
    nodes: Mapping[str, NodeView], *, active: bool, workers_placed: bool,
    old: SparesRecord | None,
) -> SpareDecision:
    """What to do about the placeholders of a job. `active`: the job runs (not finished,
    suspended or invalid); `workers_placed`: every worker has a node, so placeholders are made
    only after the workers (they never take a node a first worker needs)."""
    desired = spec.failure_policy.spare_nodes if active else 0
    lost = {name for name, node in nodes.items() if not node.ready}
    force = sorted(s.name for s in spares.values() if s.node_name in lost)
    delete = sorted(
        s.name for s in spares.values()
        if not s.deleting and s.name not in force and (s.index >= desired or s.terminal)
    )
    create: list[Manifest] = []
    if workers_placed:
        # Off lost nodes: the scheduler may still place pods there until the node is marked.
        create = [avoiding_nodes(spare_pod(job, spec, i, config), sorted(lost))
                  for i in range(desired) if i not in spares]
    action = HoldSpares(tuple(create), tuple(delete), tuple(force)) if (
        create or delete or force) else None
    status = spare_status(desired, spares, nodes) if desired or spares else None
    events = list(_events(old, status))
    if create:
        names = ", ".join(m["metadata"]["name"] for m in create)
        events.insert(0, Event.of(EventReason.SPARES_CREATED,
                                  f"created spare placeholder pods {names}"))
    return SpareDecision(action, status, tuple(events))


def spare_status(desired: int, spares: Mapping[int, SpareView],
                 nodes: Mapping[str, NodeView]) -> SparesRecord:
    """status.spares: how many spare nodes are wanted and held, which, and why not all."""
    held = sorted(s.node_name for s in spares.values() if _holds(s, nodes) and s.index < desired)
    waiting = sorted((s for s in spares.values() if s.index < desired and s.unschedulable
                      and not s.deleting), key=lambda s: s.index)
    if len(held) >= desired:
        reason, message = "Held", f"{len(held)} of {desired} spare nodes held"
    elif waiting:
        reason = "NoFreeNode"
        message = (f"{len(held)} of {desired} spare nodes held; {waiting[0].name} waits for a "
                   f"free node: {waiting[0].unschedulable}")
    else:
        reason, message = "Creating", f"{len(held)} of {desired} spare nodes held; starting"
    return SparesRecord(desired, len(held), tuple(held), reason, message[:MESSAGE_LIMIT])


def spare_nodes(spares: Mapping[int, SpareView], nodes: Mapping[str, NodeView]) -> list[str]:
    """The nodes a placeholder holds: where a replacement should go first."""
    return sorted(s.node_name for s in spares.values() if _holds(s, nodes))


def priority_classes(config: RenderConfig) -> list[Manifest]:
    """The two PriorityClasses the pods name, with the operator's default values."""
    classes = []
    if config.worker_priority_class:
        classes.append(_priority_class(
            config.worker_priority_class, WORKER_PRIORITY, "PreemptLowerPriority",
            "GeminiJob worker pods: a replacement preempts a spare placeholder"))
    if config.spare_priority_class:
        classes.append(_priority_class(
            config.spare_priority_class, SPARE_PRIORITY, "Never",
            "GeminiJob spare placeholder pods: hold a node, never preempt"))
    return classes


def ensure_priority_classes(create: Callable[[Manifest], bool], config: RenderConfig
                            ) -> list[str]:
    """Create the classes that are missing (`create` returns False for an existing one);
    existing classes are left as they are. Returns the names created."""
    return [c["metadata"]["name"] for c in priority_classes(config) if create(c)]


def _priority_class(name: str, value: int, preemption: str, description: str) -> Manifest:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name, "labels": {naming.LABEL_MANAGED_BY: naming.MANAGER}},
        "value": value,
        "globalDefault": False,
        "preemptionPolicy": preemption,
        "description": description,
    }


def _holds(spare: SpareView, nodes: Mapping[str, NodeView]) -> bool:
    node = nodes.get(spare.node_name)
    return (spare.phase == "Running" and spare.ready and not spare.deleting
            and node is not None and node.ready)


def _events(old: SparesRecord | None, new: SparesRecord | None) -> list[Event]:
    """An event when the spares become held, or a placeholder finds no free node."""
    if new is None or (old is not None and old.reason == new.reason):
        return []
    if new.reason == "Held" and new.desired:
        return [Event.of(EventReason.SPARES_HELD, new.message)]
    if new.reason == "NoFreeNode":
        return [Event.of(EventReason.SPARES_UNSCHEDULABLE, new.message)]
    return []
