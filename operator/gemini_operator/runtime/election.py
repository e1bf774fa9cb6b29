"""Leader election with a coordination.k8s.io Lease, so two operator replicas never both act.

`decide` is pure: given the Lease as read, who we are and the time, it says whether we lead
and what to write (take over an expired or free lease, renew our own, or leave another's
alone). `LeaderElector.tick` does one read-decide-write round through the client layer; a
conflict on write means another replica won the race, so we do not lead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from gemini_operator.cluster.kube import KubeClient

_MICRO = "%Y-%m-%dT%H:%M:%S.%fZ"


@dataclass(frozen=True)
class LeaseDecision:
    leads: bool  # whether we lead once `write` (if any) succeeds
    write: dict[str, Any] | None  # the Lease to create/replace, or None to leave it


def decide(
    lease: Mapping[str, Any] | None, identity: str, now: datetime, duration_seconds: int,
    name: str,
) -> LeaseDecision:
    spec = (lease or {}).get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    renewed = _parse(spec.get("renewTime"))
    duration = int(spec.get("leaseDurationSeconds") or duration_seconds)
    held_by_other = holder not in ("", identity)
    if held_by_other and renewed is not None and now < renewed + timedelta(seconds=duration):
        return LeaseDecision(False, None)
    transitions = int(spec.get("leaseTransitions") or 0) + (1 if holder != identity else 0)
    acquired = spec.get("acquireTime") if holder == identity else _format(now)
    meta: dict[str, Any] = {"name": name}
    if lease is not None:
        meta["resourceVersion"] = (lease.get("metadata") or {}).get("resourceVersion")
    return LeaseDecision(True, {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": duration_seconds,
            "acquireTime": acquired or _format(now),
            "renewTime": _format(now),
            "leaseTransitions": transitions,
        },
    })


class LeaderElector:
    """Holds or waits for the Lease `<namespace>/<name>`; call `tick` every few seconds."""

    def __init__(
        self, kube: KubeClient, namespace: str, name: str, identity: str,
        duration_seconds: int = 15, clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._kube = kube
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration_seconds = duration_seconds
        self._clock = clock or (lambda: datetime.now(UTC))
        self._led_until: datetime | None = None

    def tick(self) -> bool:
        """One round; True while we lead. A failed renewal keeps us leader only until our
        last successful renewal expires, so we stop acting before another may start."""
        now = self._clock()
        try:
            lease = self._kube.get_lease(self.namespace, self.name)
            decision = decide(lease, self.identity, now, self.duration_seconds, self.name)
            if decision.write is not None and decision.leads:
                if not self._kube.write_lease(self.namespace, decision.write):
                    self._led_until = None
                    return False
                # Stop acting a third of the lease before another replica may take over.
                self._led_until = now + timedelta(seconds=self.duration_seconds * 2 / 3)
                return True
            self._led_until = None
            return False
        except Exception:
            return self.leads(now)

    def leads(self, now: datetime | None = None) -> bool:
        moment = now or self._clock()
        return self._led_until is not None and moment < self._led_until


def _format(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(_MICRO)


def _parse(text: str | None) -> datetime | None:
    if not text:
        return None
    for fmt in (_MICRO, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None
