"""What a sidecar holds and sends (GET /inventory), and the relay of many sidecars'
inventories through one (POST /inventories)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemini.control.launcher import Parked, Progress, parked_in, progress_in
from gemini.control.messages import Peers
from gemini.control.strict import Fields, is_address

# -- inventory -------------------------------------------------------------------------------

MAX_RELAYED = 256  # sidecars one POST /inventories may name
MAX_RELAYED_INVENTORY_BYTES = 64 * 1024  # one relayed inventory (they are a few KiB)
MAX_RELAY_SECONDS = 10.0
_INVENTORY = "/inventory answer"


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


@dataclass(frozen=True)
class LocalCopy:
    """One slot of the sidecar's own shard in shared memory."""

    rank: int
    version: int
    complete: bool
    bytes: int
    checksum: int

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "version": self.version, "complete": self.complete,
                "bytes": self.bytes, "checksum": self.checksum}

    @classmethod
    def read(cls, f: Fields) -> LocalCopy:
        return cls(f.integer("rank", 0), f.integer("version"), f.boolean("complete"),
                   f.integer("bytes", 0), f.integer("checksum"))


@dataclass(frozen=True)
class ReplicaCopy:
    """One version of a peer's shard held in the replica store."""

    rank: int
    version: int
    complete: bool
    bytes: int
    received_bytes: int
    checksum: int

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "version": self.version, "complete": self.complete,
                "bytes": self.bytes, "received_bytes": self.received_bytes,
                "checksum": self.checksum}

    @classmethod
    def read(cls, f: Fields) -> ReplicaCopy:
        return cls(f.integer("rank", 0), f.integer("version"), f.boolean("complete"),
                   f.integer("bytes", 0), f.integer("received_bytes", 0),
                   f.integer("checksum"))


@dataclass(frozen=True)
class PeerSending:
    """Replication of the own shard to one peer."""

    acked_version: int = -1
    sending_version: int = -1
    last_error: str = ""
    last_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"acked_version": self.acked_version, "sending_version": self.sending_version,
                "last_error": self.last_error, "last_seconds": self.last_seconds}

    @classmethod
    def read(cls, f: Fields) -> PeerSending:
        return cls(f.integer("acked_version"), f.integer("sending_version"),
                   f.string("last_error"), f.number("last_seconds"))


@dataclass(frozen=True)
class Sending:
    """The replicator's state: what it was told, what it skipped, how it schedules."""

    mode: str
    notified_version: int
    skipped_versions: int
    fits_idle_spans: bool
    interval_iterations: int | None
    plan: str
    peers: Mapping[int, PeerSending] = field(default_factory=dict)
    # The newest own version every peer has (the trainer may then drop the older one), and
    # the steps between the last two versions the trainer wrote (1 unless replication lags).
    # Optional on read: sidecars before them did not send them.
    acknowledged_version: int = -1
    effective_interval: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "notified_version": self.notified_version,
                "skipped_versions": self.skipped_versions,
                "fits_idle_spans": self.fits_idle_spans,
                "interval_iterations": self.interval_iterations, "plan": self.plan,
                "peers": {str(r): p.to_json() for r, p in self.peers.items()},
                "acknowledged_version": self.acknowledged_version,
                "effective_interval": self.effective_interval}

    @classmethod
    def read(cls, f: Fields) -> Sending:
        peers = {r: PeerSending.read(Fields(p, f.where, f"{f.path}peers.{r}."))
                 for r, p in f.by_rank("peers").items()}
        return cls(f.string("mode"), f.integer("notified_version"),
                   f.integer("skipped_versions", 0), f.boolean("fits_idle_spans"),
                   f.opt_integer("interval_iterations"), f.string("plan"), peers,
                   _or(f.opt_integer("acknowledged_version"), -1),
                   _or(f.opt_integer("effective_interval", 1), 1))


@dataclass(frozen=True)
class MemoryUse:
    used_bytes: int
    budget_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"used_bytes": self.used_bytes, "budget_bytes": self.budget_bytes}

    @classmethod
    def read(cls, f: Fields) -> MemoryUse:
        return cls(f.integer("used_bytes", 0), f.integer("budget_bytes", 0))


@dataclass(frozen=True)
class Inventory:
    """GET /inventory: what one sidecar holds (own shard and replicas), sends and knows."""

    job: str
    rank: int
    world_size: int
    local: tuple[LocalCopy, ...]
    replicas: tuple[ReplicaCopy, ...]
    sending: Sending
    memory: MemoryUse
    placement: Peers
    # The training's last heartbeat, read from the file the trainer writes in the shared
    # memory volume (`heartbeat`: the sidecar reads it; an older one does not), so the
    # operator's poll needs no second call per pod to the launcher.
    heartbeat: bool = False
    progress: Progress | None = None
    parked: Parked | None = None  # the trainer failed and waits for an in-process restart

    def to_json(self) -> dict[str, Any]:
        doc = {"job": self.job, "rank": self.rank, "world_size": self.world_size,
               "local": [c.to_json() for c in self.local],
               "replicas": [c.to_json() for c in self.replicas],
               "sending": self.sending.to_json(), "memory": self.memory.to_json(),
               "placement": self.placement.to_json()}
        if self.heartbeat:
            doc["heartbeat"] = True
            doc["progress"] = None if self.progress is None else self.progress.to_json()
        if self.parked is not None:
            doc["parked"] = self.parked.to_json()
        return doc

    @classmethod
    def from_json(cls, doc: object) -> Inventory:
        f = Fields(doc, _INVENTORY)
        return cls(
            job=f.string("job"), rank=f.integer("rank", 0), world_size=f.integer("world_size", 1),
            local=tuple(LocalCopy.read(c) for c in f.objects("local")),
            replicas=tuple(ReplicaCopy.read(c) for c in f.objects("replicas")),
            sending=Sending.read(f.obj("sending")), memory=MemoryUse.read(f.obj("memory")),
            placement=Peers.read(f.obj("placement")),
            heartbeat=f.raw("heartbeat") is True, progress=progress_in(f),
            parked=parked_in(f),
        )

    def complete_versions(self) -> set[int]:
        """The versions of the own shard complete in shared memory."""
        return {c.version for c in self.local if c.complete}

    def copies(self) -> tuple[LocalCopy | ReplicaCopy, ...]:
        """Every shard copy this sidecar holds: its own slots, then the replicas."""
        return (*self.local, *self.replicas)

    def complete_copies(self) -> set[tuple[int, int]]:
        """(shard rank, version) of every copy held complete, own or replica."""
        return {(c.rank, c.version) for c in self.copies() if c.complete}


@dataclass(frozen=True)
class InventoriesRequest:
    """POST /inventories (the operator's control token): the sidecar asks these sidecars of
    its job for their GET /inventory, side by side, each within `timeout_seconds`, and
    answers them with its own. The operator of a large job polls one sidecar per batch of
    ranks instead of every sidecar."""

    sidecars: Mapping[int, str]  # rank -> "host:port" of its API
    timeout_seconds: float = 1.5

    def to_json(self) -> dict[str, Any]:
        return {"sidecars": {str(r): a for r, a in sorted(self.sidecars.items())},
                "timeout_seconds": self.timeout_seconds}

    @classmethod
    def from_json(cls, doc: object) -> InventoriesRequest:
        f = Fields(doc, "/inventories request")
        sidecars = f.by_rank("sidecars")
        if len(sidecars) > MAX_RELAYED:
            raise f.fail("sidecars", f"at most {MAX_RELAYED} entries", f"{len(sidecars)}")
        for rank, address in sidecars.items():
            if not is_address(address):
                raise f.fail(f"sidecars.{rank}", '"host:port"', address)
        timeout = f.number("timeout_seconds")
        if not 0 < timeout <= MAX_RELAY_SECONDS:
            raise f.fail("timeout_seconds", f"a number of seconds in (0, {MAX_RELAY_SECONDS:g}]",
                         timeout)
        return cls({r: str(a).strip() for r, a in sidecars.items()}, timeout)


def relayed_answer_bytes(sidecars: int) -> int:
    """The most a /inventories answer naming `sidecars` others may take (and the relay's)."""
    return (sidecars + 1) * MAX_RELAYED_INVENTORY_BYTES


@dataclass(frozen=True)
class InventoriesAnswer:
    """The inventories that came (the relay's own among them) and, per rank, why one did
    not. An entry that is not a valid inventory of the rank it is filed under counts as
    failed: a relay cannot vouch for another rank."""

    inventories: Mapping[int, Inventory]
    failed: Mapping[int, str]

    def to_json(self) -> dict[str, Any]:
        return {"inventories": {str(r): i.to_json() for r, i in sorted(self.inventories.items())},
                "failed": {str(r): why for r, why in sorted(self.failed.items())}}

    @classmethod
    def from_json(cls, doc: object) -> InventoriesAnswer:
        f = Fields(doc, "/inventories answer")
        failed = {r: str(why)[:500] for r, why in f.by_rank("failed", required=False).items()}
        inventories: dict[int, Inventory] = {}
        for rank, raw in f.by_rank("inventories").items():
            try:
                inventory = Inventory.from_json(raw)
            except ValueError as err:
                failed[rank] = f"relayed an invalid inventory: {err}"[:500]
                continue
            if inventory.rank != rank:
                failed[rank] = f"relayed the inventory of rank {inventory.rank}"
            else:
                inventories[rank] = inventory
        return cls(inventories, failed)
