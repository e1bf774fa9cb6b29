"""How replication keeps up with the snapshots, from the sidecars' inventories (pure).

The recoverable step is the newest step every holder has of every shard: each sidecar
acknowledges its own newest version once all its peers have it, and the trainers never write
over the newest acknowledged one. While a newer one is on its way they skip snapshots
together, so the effective interval (steps between the last two snapshots) grows by itself;
the reason says what the sidecars measured: bytes per version against the time a send took.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gemini.control.inventory import Inventory

MIB = 1 << 20


@dataclass(frozen=True)
class Pace:
    recoverable_step: int | None
    effective_interval: int
    lag_steps: int | None
    reason: str


def replication_pace(inventories: Mapping[int, Inventory]) -> Pace | None:
    """The job's pace, or None without any inventory."""
    if not inventories:
        return None
    sending = [inv.sending for inv in inventories.values()]
    acked = min(s.acknowledged_version for s in sending)
    recoverable = acked if acked >= 0 else None
    newest = max(s.notified_version for s in sending)
    lag = newest - recoverable if recoverable is not None and newest >= 0 else None
    interval = max(s.effective_interval for s in sending)
    return Pace(recoverable, interval, lag, _slowest_send(inventories))


def _slowest_send(inventories: Mapping[int, Inventory]) -> str:
    slowest: tuple[float, int, int] | None = None  # seconds, bytes, rank
    for rank, inv in inventories.items():
        seconds = max((p.last_seconds for p in inv.sending.peers.values()), default=0.0)
        size = max((c.bytes for c in inv.local if c.complete), default=0)
        if seconds > 0 and size and (slowest is None or seconds > slowest[0]):
            slowest = (seconds, size, rank)
    if slowest is None:
        return "no replication measured yet"
    seconds, size, rank = slowest
    return (f"a version of {size / MIB:.1f} MiB reaches its peers in {seconds:.2f} s, "
            f"{size / MIB / seconds:.1f} MiB/s (rank {rank}, the slowest)")
