"""The Kueue side of a queued job (queueing.py): its Workload read, created and patched
through the API layer, the assigned flavors' node labels looked up (and kept a while: they
change rarely and every reconcile of an admitted job needs them)."""

from __future__ import annotations

import time
from collections.abc import Callable

from gemini_operator.cluster.kube import KubeClient, KubeError
from gemini_operator.core import queueing
from gemini_operator.core.actions import CreateWorkload, DeleteWorkload, PatchWorkload
from gemini_operator.core.events import Event, EventReason
from gemini_operator.core.outcome import Outcome
from gemini_operator.core.queueing import Flavor, Manifest, WorkloadView
from gemini_operator.core.types import JobView

FLAVOR_SECONDS = 30.0  # how long a ResourceFlavor read is reused


class Workloads:
    def __init__(self, kube: KubeClient,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self._monotonic = monotonic
        self._flavors: dict[str, tuple[float, Flavor]] = {}

    def observe(self, job: JobView) -> WorkloadView | None:
        """The job's Workload, with its flavors' placement once admitted; None when absent
        (or when Kueue is not installed: creating it then says so)."""
        obj = self.kube.get_workload(job.namespace, queueing.workload_name(job.ref))
        if obj is None:
            return None
        view = queueing.workload_view(obj)
        if view.owner_uid != job.uid:
            return view  # not this job's: never adopted (decide fails the job naming it)
        if not view.admitted:
            return view
        return view.with_placement([self._flavor(name) for name in view.flavors])

    def create(self, job: JobView, action: CreateWorkload) -> Outcome:
        manifest = action.manifest
        name = manifest["metadata"]["name"]
        try:
            manifest = self._with_priority(manifest)
            created = self.kube.create_workload(manifest)
        except KubeError as err:
            return Outcome(requeue_after=queueing.POLL_SECONDS * 5, events=[
                Event.of(EventReason.QUEUE_UNAVAILABLE, str(err))])
        if not created:
            return Outcome()
        queue = action.manifest["spec"]["queueName"]
        return Outcome(requeue_after=queueing.POLL_SECONDS, events=[Event.of(
            EventReason.WORKLOAD_CREATED,
            f"created Workload {name} in LocalQueue {queue!r}: the job waits for Kueue to "
            "admit it")])

    def _with_priority(self, manifest: Manifest) -> Manifest:
        """The Workload with its priority class's value (Kueue's webhook would fill it in;
        its scheduler reads only the value)."""
        spec = manifest["spec"]
        ref = spec.get("priorityClassRef")
        if not ref:
            return manifest
        name, kind = ref["name"], ref["kind"]
        value = self.kube.priority_value(name, kind == queueing.WORKLOAD_PRIORITY_CLASS["kind"])
        if value is None:
            raise KubeError(f"{kind} {name!r} does not exist: create it, or name another "
                            f"(label {queueing.PRIORITY_LABEL} or the pod template's "
                            "priorityClassName)")
        return {**manifest, "spec": {**spec, "priority": value}}

    def patch(self, job: JobView, action: PatchWorkload) -> Outcome:
        if not self.kube.patch_workload_status(job.namespace, action.name, action.patch):
            return Outcome(requeue_after=0.2)  # Kueue wrote since: decide again
        return Outcome(events=[Event.of(EventReason.WORKLOAD_UPDATED,
                                        f"Workload {action.name}: {action.what}")])

    def delete(self, job: JobView, action: DeleteWorkload) -> Outcome:
        self.kube.delete_workload(job.namespace, action.name)
        return Outcome(events=[Event.of(EventReason.WORKLOAD_UPDATED,
                                        f"Workload {action.name}: deleted, {action.why}")])

    def _flavor(self, name: str) -> Flavor:
        now = self._monotonic()
        kept = self._flavors.get(name)
        if kept is not None and now - kept[0] < FLAVOR_SECONDS:
            return kept[1]
        obj = self.kube.get_resource_flavor(name)
        flavor = queueing.flavor_of(obj) if obj is not None else Flavor()
        self._flavors[name] = (now, flavor)
        return flavor
