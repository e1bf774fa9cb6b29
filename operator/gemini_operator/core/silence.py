"""A lost node found from the job's own signals, before the node controller says so.

Kubernetes marks a node NotReady only after --node-monitor-grace-period (40 s or more by
default). A node that is gone shows in the job much earlier: its pods stop answering. But a pod
also stops answering while it starts, while a container restarts, or when it is only slow, so
a pod counts as silent only while all of these hold, and its node is presumed lost once one of
its pods has been silent for SILENT_S:

- it answered before (a pod that never did is starting, not lost);
- connections to its sidecar and to its launcher are refused or time out (a slow or stopped
  process still has its connections accepted by the kernel: that is a hang, found elsewhere);
- the API still shows it running and ready (when its containers die on a live node, the kubelet
  reports it within a second or two: a container failure, handled as one).

The poller presumes such a node lost for PRESUME_S (cache.presume_lost), long enough for the
node controller to take over when the node is really gone. A recovery under way (often begun
by a survivor's crash: the lost node broke its collective) does not wait the confirmation
time: a pod it needs that refuses both connections is presumed on its node at once
(`suspects`, recovery.py). Pure: the callers feed it what they observed and when.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gemini_operator.core.observed import PodView

SILENT_S = 3.0  # two polls apart at least: one refused connection is not enough
PRESUME_S = 120.0


@dataclass
class SilenceTracker:
    """One job's pods: which answered, and since when each has been silent."""

    silent_s: float = SILENT_S
    silent_since: dict[str, float] = field(default_factory=dict)  # pod uid -> first silent

    def heard(self, pods: Iterable[PodView]) -> None:
        for pod in pods:
            self.silent_since.pop(pod.uid, None)

    def silent_nodes(self, probed: Mapping[int, PodView], unreachable: Iterable[int],
                     now: float) -> dict[str, float]:
        """Nodes presumed lost now -> since when their pod has been silent. ``probed``: the
        pods probed (``to_probe``), ``unreachable``: those whose connections all failed."""
        down = set(unreachable)
        for rank, pod in probed.items():
            if rank in down:
                self.silent_since.setdefault(pod.uid, now)
            else:
                self.silent_since.pop(pod.uid, None)  # slow, not gone
        lost: dict[str, float] = {}
        for rank in sorted(down & set(probed)):
            pod = probed[rank]
            since = self.silent_since[pod.uid]
            if now - since >= self.silent_s and pod.node_name:
                lost[pod.node_name] = min(since, lost.get(pod.node_name, since))
        return lost

    def keep_only(self, pods: Iterable[PodView]) -> None:
        """Forget pods that are gone (replaced pods have new uids)."""
        uids = {p.uid for p in pods}
        self.silent_since = {u: t for u, t in self.silent_since.items() if u in uids}


def suspects(pods: Mapping[int, PodView], answering: Iterable[int],
             answered: Callable[[str], bool]) -> dict[int, PodView]:
    """The pods worth probing: silent now, answered before (``answered(uid)``), and shown
    running and ready by the API."""
    quiet = set(pods) - set(answering)
    return {r: pods[r] for r in sorted(quiet) if _looks_alive(pods[r]) and answered(pods[r].uid)}


def _looks_alive(pod: PodView) -> bool:
    return pod.phase == "Running" and pod.ready and not pod.deleting
