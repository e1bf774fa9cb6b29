"""Placement delivery: each sidecar gets its part of status.placement (POST /peers).

One path and one body shape (gemini.control's `Peers`, from `sidecars.peers_bodies`) for
everyone who delivers: the reconciler (in the background, retried with backoff), a recovery
(before replacements fetch from their peers) and the poller (to sidecars that restarted
without their part).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from gemini.control.auth import Bearer
from gemini.control.inventory import Inventory
from gemini.control.messages import Peers
from gemini.domain.placement import Placement
from gemini_operator.calls.sidecars import (
    DELIVERY_TIMEOUT_SECONDS,
    DeliveryError,
    SidecarAddress,
    deliver_peers,
    peers_bodies,
)
from gemini_operator.core.observed import PodView
from gemini_operator.core.render import RenderConfig


def sidecar_addresses(pods: Mapping[int, PodView], ports: RenderConfig
                      ) -> dict[int, SidecarAddress]:
    return {r: SidecarAddress(r, p.ip, ports.sidecar_api_port, ports.sidecar_port)
            for r, p in pods.items()}


def deliver(
    placement: Placement, pods: Mapping[int, PodView], ports: RenderConfig, token: Bearer,
    ranks: Collection[int] | None = None, timeout: float = DELIVERY_TIMEOUT_SECONDS,
) -> int:
    """POST each rank's part of `placement` to its sidecar (those of `ranks`, default every
    rank's), in parallel; the number of sidecars that took it. Raises DeliveryError (how
    many of how many did not, and why) after trying every one."""
    addresses = sidecar_addresses(pods, ports)
    bodies = peers_bodies(placement, addresses)
    if ranks is not None:
        bodies = {r: body for r, body in bodies.items() if r in ranks}
    errors = deliver_peers(addresses, bodies, token, timeout)
    if errors:
        raise DeliveryError(errors, len(bodies))
    return len(bodies)


def stale_ranks(placement: Placement, pods: Mapping[int, PodView], ports: RenderConfig,
                inventories: Mapping[int, Inventory]) -> list[int]:
    """The ranks whose sidecar reports a placement other than its part of `placement`."""
    bodies = peers_bodies(placement, sidecar_addresses(pods, ports))
    return sorted(stale_placements(inventories, bodies))


def stale_placements(inventories: Mapping[int, Inventory],
                     bodies: Mapping[int, Peers]) -> dict[int, Peers]:
    """The /peers bodies of the sidecars whose placement is not the delivered one. A sidecar
    that restarted (its container crashed) starts without one: it would neither send its own
    shard to its holders nor accept its peers' replicas, so their coverage would stay lost."""
    return {rank: bodies[rank] for rank, inventory in inventories.items()
            if rank in bodies and not inventory.placement.same_ranks(bodies[rank])}
