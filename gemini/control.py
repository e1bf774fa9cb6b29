"""The control contract between the operator, the checkpoint sidecar and the launcher.

Both APIs are JSON over HTTP with the job token as ``Authorization: Bearer <token>`` (only
the health and metrics paths are open). This module is the one place that names their paths,
the body of every request and answer (frozen dataclasses with ``to_json`` and ``from_json``),
the error answer ``{"error": "<what to fix>"}`` that goes with a 4xx/5xx status, and the one
client (``ControlClient``). The field names are the wire names; ``to_json`` writes the same
JSON the hand-built dicts did before, so older and newer peers understand each other.

Reading is strict: a missing required key or a value of the wrong type raises ValueError
naming the field (the servers answer it with 400). Keys a reader does not know are ignored,
so a newer sender can add a field without breaking an older receiver during an upgrade.

Ordering rules (what the servers require of their callers, and why):

1. Placement first. A sidecar starts with the placement of its pod's environment (none for a
   replacement that has not been placed yet); ``POST /peers`` replaces it as a whole. It must
   have its placement before
   - ``POST /fetch`` names holders by rank (their addresses come from the placement; a
     ``"host:port"`` holder needs none) or fetches into its replica store (``into: "store"``:
     only a rank it holds), and before ``POST /fetch-replicas`` (it re-pulls exactly the ranks
     it holds): otherwise 400 "... POST /peers first";
   - the trainers start: the operator sends the first ``POST /restart`` only once every
     sidecar took its placement (condition PlacementDelivered), or the first snapshots are
     sent to nobody and peers refuse replicas of ranks they do not hold.
   A new placement drops the replicas of ranks no longer held. A sidecar whose container
   restarted comes back with its environment's placement: the operator compares
   ``GET /inventory``'s ``placement`` with the delivered one and posts it again.
2. Inventory before the plan. A recovery reads every live sidecar's ``GET /inventory`` and
   plans from it (and from S3's committed steps, which a sidecar lists: ``GET
   /committed-steps``; the operator holds no S3 credentials); the version named in ``/fetch``,
   ``/fetch-replicas``, ``/restore`` and ``/restart`` is the plan's, never "the newest":
   survivors may hold newer versions of the abandoned run.
3. Memory before the restart. Every shard to be restored must be complete in its rank's
   shared memory before its launcher gets ``POST /restart`` with that version: a
   replacement's own shard by ``POST /fetch`` (``into: "shm"``) from a peer, or every rank's
   by ``POST /restore`` from S3. A replacement's replicas of its peers come back with
   ``POST /fetch-replicas`` at the same version, after its placement (rule 1).
4. Persist, then commit. ``POST /persist`` of one version on every rank, and only when all
   succeeded ``POST /commit`` of that version on one of them (the lowest rank): the commit
   verifies every rank's object and writes the marker that makes the step visible.
   ``POST /restore`` restores committed steps of its own job only (the marker names the
   namespace, job, uid and world size; another's is refused).
5. Notify after the commit in shared memory. The trainer posts ``/v1/local/committed`` (or
   ``/notify``) for a version only after its slot is complete; the sidecar replicates it.
6. Launcher epochs only grow. ``POST /restart`` with a newer epoch restarts the training
   process; the same epoch again is a no-op answered ``"already"`` (a retry is safe); an
   older one is refused with 409. A held launcher (hold mode) runs nothing before its first
   ``/restart``. A launcher whose container restarted comes back held at its environment's
   epoch: after ``/restart``, ``GET /status`` tells which launchers run the new epoch, and
   the others are sent it again. ``POST /stop`` ends the launcher; nothing follows it.
7. Transfers run in the background. ``/fetch``, ``/fetch-replicas``, ``/persist`` and
   ``/restore`` start a transfer, or join the one already running for the same request (the
   same rank, version and target): a retry never starts a second copy. A request with
   ``wait_seconds`` is answered when the transfer ends or after that many seconds, whichever
   comes first; in the second case with 202 and a ``TransferRunning`` (bytes done of the
   total), and the caller asks again to join it. Without ``wait_seconds`` the answer waits
   for the end. A failed transfer is answered with its error once; the next request starts
   a new one.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import io
import json
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

# -- paths of the sidecar's API --------------------------------------------------------------
HEALTHZ_PATH = "/healthz"  # GET, open: liveness
METRICS_PATH = "/metrics"  # GET, open: Prometheus text (the launcher's too)
INVENTORY_PATH = "/inventory"  # GET -> Inventory
NOTIFY_PATH = "/notify"  # POST NotifyRequest -> NotifyAnswer (202)
COMMITTED_PATH = "/v1/local/committed"  # the same call, the path the trainer library uses
PEERS_PATH = "/peers"  # POST Peers -> Peers (the placement now in force)
PROFILE_PATH = "/profile"  # POST ProfileRequest -> ProfileAnswer
FETCH_PATH = "/fetch"  # POST FetchRequest -> FetchAnswer
FETCH_REPLICAS_PATH = "/fetch-replicas"  # POST FetchReplicasRequest -> FetchReplicasAnswer
PERSIST_PATH = "/persist"  # POST PersistRequest -> PersistAnswer
COMMIT_PATH = "/commit"  # POST CommitRequest -> CommitAnswer
RESTORE_PATH = "/restore"  # POST RestoreRequest -> RestoreAnswer
COMMITTED_STEPS_PATH = "/committed-steps"  # GET -> CommittedStepsAnswer
INVENTORIES_PATH = "/inventories"  # POST InventoriesRequest -> InventoriesAnswer (a relay)
SIDECAR_OPEN_PATHS = frozenset({HEALTHZ_PATH, METRICS_PATH})
# What the trainer of the pod calls with the job token (reads go with it too; see may_call).
SIDECAR_TRAINER_PATHS = frozenset({NOTIFY_PATH, COMMITTED_PATH, PROFILE_PATH})

# -- paths of the launcher's API -------------------------------------------------------------
STATUS_PATH = "/status"  # GET -> LauncherStatus
RESTART_PATH = "/restart"  # POST RestartRequest -> RestartAnswer
STOP_PATH = "/stop"  # POST (any object) -> LauncherStatus; the launcher then exits
LAUNCHER_OPEN_PATHS = frozenset({METRICS_PATH})
# The operator's hint server (gemini_operator.hints), called by launchers.
FAILURE_HINT_PATH = "/v1/hints/failure"  # POST FailureHint -> HintAnswer (202)
MAX_HINT_BYTES = 4096

RESTORE_SOURCES = ("local", "peer", "s3")
LAUNCHER_STATES = ("starting", "held", "running", "parked", "exited", "stopped")
RESTART_RESULTS = ("restarted", "already")
FETCH_TARGETS = ("shm", "store")
TRANSFER_KINDS = ("fetch", "fetch-replicas", "persist", "restore")
MAX_WAIT_SECONDS = 60.0  # a transfer request's wait_seconds: longer would hold the call open
MAX_RESTART_ENV = 64  # names a restart may add to the training process's environment
MAX_RELAYED = 256  # sidecars one POST /inventories may name
MAX_RELAYED_INVENTORY_BYTES = 64 * 1024  # one relayed inventory (they are a few KiB)
MAX_RELAY_SECONDS = 10.0
DEFAULT_TIMEOUT_SECONDS = 5.0

Holder = int | str  # a rank (its address from the placement) or "host:port"
T = TypeVar("T")
_MISSING: Any = object()


# -- reading JSON strictly -------------------------------------------------------------------

def _shown(value: object) -> str:
    """The offending value for a message: short enough for a log line and an API answer."""
    text = repr(value)
    text = text if len(text) <= 120 else text[:117] + "..."
    return "null" if value is None else f"{text} ({type(value).__name__})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # str.isdigit alone takes "²", which int() refuses


def _is_address(value: object) -> bool:
    if not isinstance(value, str):
        return False
    host, sep, port = value.strip().rpartition(":")
    return bool(sep and host and _digits(port) and 0 < int(port) < 65536)


class _Fields:
    """Typed reads of one JSON object; every refusal names the body and the field's path."""

    def __init__(self, doc: object, where: str, path: str = "") -> None:
        if not isinstance(doc, dict):
            what = f"'{path.rstrip('.')}'" if path else "the body"
            raise ValueError(f"{where}: {what} must be a JSON object, got {_shown(doc)}")
        self._doc: dict[str, Any] = doc
        self.where, self.path = where, path

    def fail(self, key: str, must: str, value: object) -> ValueError:
        return ValueError(f"{self.where}: '{self.path}{key}' must be {must}, got {_shown(value)}")

    def _get(self, key: str, required: bool) -> Any:
        value = self._doc.get(key, _MISSING)
        if value is _MISSING and required:
            raise ValueError(f"{self.where}: '{self.path}{key}' is required")
        return value

    def _checked(self, key: str, ok: Callable[[Any], bool], must: str, required: bool) -> Any:
        value = self._get(key, required)
        if value is not _MISSING and not ok(value):
            raise self.fail(key, must, value)
        return value

    def integer(self, key: str, minimum: int | None = None) -> int:
        must = "an integer" if minimum is None else f"an integer >= {minimum}"
        return int(self._checked(
            key, lambda v: _is_int(v) and (minimum is None or v >= minimum), must, True))

    def opt_integer(self, key: str, minimum: int | None = None) -> int | None:
        """Missing or null: None."""
        must = "an integer or null" if minimum is None else f"an integer >= {minimum} or null"
        value = self._checked(
            key, lambda v: v is None or (_is_int(v) and (minimum is None or v >= minimum)),
            must, False)
        return None if value is _MISSING or value is None else int(value)

    def number(self, key: str) -> float:
        return float(self._checked(key, _is_number, "a number", True))

    def opt_number(self, key: str) -> float | None:
        value = self._checked(key, lambda v: v is None or _is_number(v), "a number or null",
                              False)
        return None if value is _MISSING or value is None else float(value)

    def boolean(self, key: str) -> bool:
        return bool(self._checked(key, lambda v: isinstance(v, bool), "true or false", True))

    def string(self, key: str) -> str:
        return str(self._checked(key, lambda v: isinstance(v, str), "a string", True))

    def opt_string(self, key: str) -> str | None:
        value = self._checked(key, lambda v: v is None or isinstance(v, str),
                              "a string or null", False)
        return None if value is _MISSING or value is None else str(value)

    def ranks(self, key: str, required: bool = False, what: str = "ranks") -> tuple[int, ...]:
        """A list of non-negative integers (ranks, steps); missing (when optional): empty."""
        value = self._checked(key, lambda v: isinstance(v, list) and all(
            _is_int(r) and r >= 0 for r in v), f"a list of {what} (integers >= 0)", required)
        return () if value is _MISSING else tuple(value)

    def strings(self, key: str) -> tuple[str, ...]:
        return tuple(self._checked(key, lambda v: isinstance(v, list) and all(
            isinstance(s, str) for s in v), "a list of strings", True))

    def holders(self, key: str) -> tuple[Holder, ...]:
        """A list of holders, each a rank or "host:port"; missing: empty."""
        value = self._get(key, False)
        return () if value is _MISSING else self.holders_of(key, value)

    def holders_of(self, name: str, value: object) -> tuple[Holder, ...]:
        if not isinstance(value, list) or not all(
                (_is_int(h) and h >= 0) or _is_address(h) for h in value):
            raise self.fail(name, 'a list of holders (ranks or "host:port")', value)
        return tuple(value)

    def obj(self, key: str) -> _Fields:
        return _Fields(self._get(key, True), self.where, f"{self.path}{key}.")

    def opt_obj(self, key: str) -> _Fields | None:
        value = self._get(key, False)
        if value is _MISSING or value is None:
            return None
        return _Fields(value, self.where, f"{self.path}{key}.")

    def objects(self, key: str) -> list[_Fields]:
        value = self._checked(key, lambda v: isinstance(v, list), "a list of objects", True)
        return [_Fields(item, self.where, f"{self.path}{key}[{i}].")
                for i, item in enumerate(value)]

    def by_rank(self, key: str, required: bool = True) -> dict[int, Any]:
        """An object keyed by rank ("0", "1", ...): rank -> value, in the sender's order."""
        value = self._checked(key, lambda v: isinstance(v, dict) and all(
            isinstance(r, str) and _digits(r) for r in v),
            'an object keyed by rank ("0", "1", ...)', required)
        return {} if value is _MISSING else {int(r): v for r, v in value.items()}

    def raw(self, key: str) -> Any:
        """The value as sent (None when missing): for fields of several shapes."""
        value = self._get(key, False)
        return None if value is _MISSING else value


def _peer_map(f: _Fields) -> dict[int, str]:
    """`peers`: an object of rank -> "host:port", or the environment's "0=host:port,..."."""
    raw = f.raw("peers")
    if isinstance(raw, str):
        return _peer_text(f, raw)
    peers = f.by_rank("peers", required=False)
    for rank, address in peers.items():
        if not _is_address(address):
            raise f.fail(f"peers.{rank}", '"host:port"', address)
    return peers


def _peer_text(f: _Fields, text: str) -> dict[int, str]:
    if text.strip().startswith("{"):
        try:
            doc = parse_json(text)  # a peer's text: strict, like every answer
        except ValueError as err:
            raise f.fail("peers", "an object of rank -> host:port", text) from err
        return _peer_map(_Fields({"peers": doc}, f.where, f.path))
    out: dict[int, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        rank, sep, address = item.partition("=")
        if not sep or not _digits(rank.strip()) or not _is_address(address):
            raise f.fail("peers", 'entries "rank=host:port"', item)
        out[int(rank)] = address.strip()
    return out


# -- the error answer and health ---------------------------------------------------------------

def _wait_of(f: _Fields) -> float | None:
    """A transfer request's `wait_seconds` (None: wait for the end)."""
    wait = f.opt_number("wait_seconds")
    if wait is not None and not 0 <= wait <= MAX_WAIT_SECONDS:
        raise f.fail("wait_seconds", f"a number of seconds from 0 to {MAX_WAIT_SECONDS:g}",
                     wait)
    return wait


def _with_wait(doc: dict[str, Any], wait: float | None) -> dict[str, Any]:
    if wait is not None:
        doc["wait_seconds"] = wait
    return doc


@dataclass(frozen=True)
class ErrorAnswer:
    """What every refusal carries, with a 4xx/5xx status: what to fix."""

    error: str

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error}

    @classmethod
    def from_json(cls, doc: object) -> ErrorAnswer:
        return cls(_Fields(doc, "error answer").string("error"))


@dataclass(frozen=True)
class Health:
    """GET /healthz."""

    status: str = "ok"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status}

    @classmethod
    def from_json(cls, doc: object) -> Health:
        return cls(_Fields(doc, "/healthz answer").string("status"))


# -- notify: the trainer committed a version in shared memory ----------------------------------

@dataclass(frozen=True)
class NotifyRequest:
    """POST /v1/local/committed (or /notify): `version` is complete in shm. The trainer also
    sends where and what it wrote; the sidecar needs only the version and the stall."""

    version: int
    stall_seconds: float | None = None  # how long the training loop was stalled copying it
    rank: int | None = None
    seq: int | None = None
    slot: int | None = None
    bytes: int | None = None
    checksum: int | None = None
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"rank": self.rank, "version": self.version, "seq": self.seq,
                               "slot": self.slot, "bytes": self.bytes,
                               "checksum": self.checksum, "path": self.path,
                               "stall_seconds": self.stall_seconds}
        return {k: v for k, v in doc.items() if v is not None or k == "version"}

    @classmethod
    def from_json(cls, doc: object) -> NotifyRequest:
        f = _Fields(doc, "/notify body")
        return cls(
            version=f.integer("version", 0), stall_seconds=f.opt_number("stall_seconds"),
            rank=f.opt_integer("rank", 0), seq=f.opt_integer("seq"),
            slot=f.opt_integer("slot", 0), bytes=f.opt_integer("bytes", 0),
            checksum=f.opt_integer("checksum"), path=f.opt_string("path"),
        )


@dataclass(frozen=True)
class NotifyAnswer:
    accepted: int  # the version the sidecar will replicate (answered with 202)

    def to_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted}

    @classmethod
    def from_json(cls, doc: object) -> NotifyAnswer:
        return cls(_Fields(doc, "/notify answer").integer("accepted"))


# -- placement -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peers:
    """A sidecar's placement as the API carries it: the POST /peers body, its answer, and
    the inventory's `placement`. Every key is optional on the wire (missing: empty)."""

    peers: Mapping[int, str] = field(default_factory=dict)  # rank -> its peer "host:port"
    hold_ranks: tuple[int, ...] = ()  # ranks whose shards this sidecar keeps replicas of
    send_to: tuple[int, ...] = ()  # ranks this sidecar sends its own shard to

    def to_json(self) -> dict[str, Any]:
        return {"peers": {str(r): a for r, a in self.peers.items()},
                "hold_ranks": list(self.hold_ranks), "send_to": list(self.send_to)}

    @classmethod
    def from_json(cls, doc: object, where: str = "/peers body") -> Peers:
        return cls.read(_Fields(doc, where))

    @classmethod
    def read(cls, f: _Fields) -> Peers:
        return cls(_peer_map(f), f.ranks("hold_ranks"), f.ranks("send_to"))

    def same_ranks(self, other: Peers) -> bool:
        """Whether both hold and send to the same ranks (order and addresses aside): a
        sidecar whose inventory placement differs from the delivered one needs it again."""
        return (set(self.hold_ranks) == set(other.hold_ranks)
                and set(self.send_to) == set(other.send_to))


# -- inventory -------------------------------------------------------------------------------

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
    def read(cls, f: _Fields) -> LocalCopy:
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
    def read(cls, f: _Fields) -> ReplicaCopy:
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
    def read(cls, f: _Fields) -> PeerSending:
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
    def read(cls, f: _Fields) -> Sending:
        peers = {r: PeerSending.read(_Fields(p, f.where, f"{f.path}peers.{r}."))
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
    def read(cls, f: _Fields) -> MemoryUse:
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
        f = _Fields(doc, _INVENTORY)
        return cls(
            job=f.string("job"), rank=f.integer("rank", 0), world_size=f.integer("world_size", 1),
            local=tuple(LocalCopy.read(c) for c in f.objects("local")),
            replicas=tuple(ReplicaCopy.read(c) for c in f.objects("replicas")),
            sending=Sending.read(f.obj("sending")), memory=MemoryUse.read(f.obj("memory")),
            placement=Peers.read(f.obj("placement")),
            heartbeat=f.raw("heartbeat") is True, progress=_progress(f),
            parked=_parked(f),
        )

    def complete_versions(self) -> set[int]:
        """The versions of the own shard complete in shared memory."""
        return {c.version for c in self.local if c.complete}

    def copies(self) -> tuple[LocalCopy | ReplicaCopy, ...]:
        """Every shard copy this sidecar holds: its own slots, then the replicas."""
        return (*self.local, *self.replicas)


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
        f = _Fields(doc, "/inventories request")
        sidecars = f.by_rank("sidecars")
        if len(sidecars) > MAX_RELAYED:
            raise f.fail("sidecars", f"at most {MAX_RELAYED} entries", f"{len(sidecars)}")
        for rank, address in sidecars.items():
            if not _is_address(address):
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
        f = _Fields(doc, "/inventories answer")
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


# -- traffic profile -------------------------------------------------------------------------

@dataclass(frozen=True)
class ProfileIteration:
    length: float  # seconds
    ops: tuple[tuple[float, float], ...]  # [start, end] of the training's own traffic


@dataclass(frozen=True)
class ProfileRequest:
    """POST /profile: when the training's own traffic runs in an iteration, so replication
    goes into the idle spans."""

    iterations: tuple[ProfileIteration, ...]

    def to_json(self) -> dict[str, Any]:
        return {"iterations": [{"length": it.length, "ops": [list(op) for op in it.ops]}
                               for it in self.iterations]}

    @classmethod
    def from_json(cls, doc: object) -> ProfileRequest:
        f = _Fields(doc, "/profile body")
        iterations = tuple(_iteration(it) for it in f.objects("iterations"))
        if not iterations:
            raise ValueError("/profile body: 'iterations' must not be empty")
        return cls(iterations)


def _iteration(f: _Fields) -> ProfileIteration:
    ops = f.raw("ops")
    if not isinstance(ops, list) or not all(
            isinstance(op, list) and len(op) == 2 and all(_is_number(x) for x in op)
            for op in ops):
        raise f.fail("ops", "a list of [start, end] pairs of numbers", ops)
    return ProfileIteration(f.number("length"), tuple((float(a), float(b)) for a, b in ops))


@dataclass(frozen=True)
class ProfileAnswer:
    iterations: int

    def to_json(self) -> dict[str, Any]:
        return {"iterations": self.iterations}

    @classmethod
    def from_json(cls, doc: object) -> ProfileAnswer:
        return cls(_Fields(doc, "/profile answer").integer("iterations", 0))


# -- fetch from peers --------------------------------------------------------------------------

@dataclass(frozen=True)
class FetchRequest:
    """POST /fetch: pull `version` (None: the newest complete) of `rank` from `holders` (none:
    the rank's own sidecar) into shm (the own rank) or the replica store (a held rank)."""

    rank: int
    version: int | None = None
    holders: tuple[Holder, ...] = ()
    into: Literal["shm", "store"] | None = None  # None: shm for the own rank, else store
    wait_seconds: float | None = None  # rule 7

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"rank": self.rank, "version": self.version,
                               "holders": list(self.holders)}
        if self.into is not None:
            doc["into"] = self.into
        return _with_wait(doc, self.wait_seconds)

    @classmethod
    def from_json(cls, doc: object) -> FetchRequest:
        f = _Fields(doc, "/fetch body")
        into = f.raw("into")
        if into is not None and into not in FETCH_TARGETS:
            raise f.fail("into", '"shm", "store" or null', into)
        return cls(f.integer("rank", 0), f.opt_integer("version", 0), f.holders("holders"),
                   into, _wait_of(f))


@dataclass(frozen=True)
class FetchAnswer:
    """What /fetch placed: its version, length and CRC-32, and the holders it came from."""

    rank: int
    version: int
    length: int
    checksum: int
    holders_used: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "version": self.version, "length": self.length,
                "checksum": self.checksum, "holders_used": list(self.holders_used)}

    @classmethod
    def from_json(cls, doc: object) -> FetchAnswer:
        f = _Fields(doc, "/fetch answer")
        return cls(f.integer("rank", 0), f.integer("version", 0), f.integer("length", 0),
                   f.integer("checksum"), f.strings("holders_used"))


@dataclass(frozen=True)
class FetchReplicasRequest:
    """POST /fetch-replicas: re-pull every held rank at `version` (None: the newest complete),
    from the holders given per rank, else from that rank's own sidecar."""

    holders: Mapping[int, tuple[Holder, ...]] = field(default_factory=dict)
    version: int | None = None
    wait_seconds: float | None = None  # rule 7

    def to_json(self) -> dict[str, Any]:
        return _with_wait({"holders": {str(r): list(hs) for r, hs in self.holders.items()},
                           "version": self.version}, self.wait_seconds)

    @classmethod
    def from_json(cls, doc: object) -> FetchReplicasRequest:
        f = _Fields(doc, "/fetch-replicas body")
        raw = f.raw("holders")  # null: none given, as missing
        given = f.by_rank("holders") if raw is not None else {}
        holders = {r: f.holders_of(f"holders.{r}", hs) for r, hs in given.items()}
        return cls(holders, f.opt_integer("version", 0), _wait_of(f))


@dataclass(frozen=True)
class ReplicaFetch:
    """One held rank's outcome in /fetch-replicas: what came, or why not (`error`)."""

    rank: int
    version: int | None = None
    bytes: int | None = None
    holders_used: tuple[str, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"rank": self.rank, "error": self.error}
        return {"rank": self.rank, "version": self.version, "bytes": self.bytes,
                "holders_used": list(self.holders_used)}

    @classmethod
    def read(cls, f: _Fields) -> ReplicaFetch:
        error = f.opt_string("error")
        if error is not None:
            return cls(f.integer("rank", 0), error=error)
        return cls(f.integer("rank", 0), f.integer("version", 0), f.integer("bytes", 0),
                   f.strings("holders_used"))


@dataclass(frozen=True)
class FetchReplicasAnswer:
    """Answered with 200 when every held rank came, else 502 (with the same body)."""

    replicas: tuple[ReplicaFetch, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.replicas)

    def to_json(self) -> dict[str, Any]:
        return {"replicas": [r.to_json() for r in self.replicas]}

    @classmethod
    def from_json(cls, doc: object) -> FetchReplicasAnswer:
        f = _Fields(doc, "/fetch-replicas answer")
        return cls(tuple(ReplicaFetch.read(r) for r in f.objects("replicas")))


# -- S3 --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PersistRequest:
    """POST /persist: upload `version` (None: the newest complete) of the own shard to S3."""

    version: int | None = None
    wait_seconds: float | None = None  # rule 7

    def to_json(self) -> dict[str, Any]:
        return _with_wait({"version": self.version}, self.wait_seconds)

    @classmethod
    def from_json(cls, doc: object) -> PersistRequest:
        f = _Fields(doc, "/persist body")
        return cls(f.opt_integer("version", 0), _wait_of(f))


@dataclass(frozen=True)
class PersistAnswer:
    key: str
    version: int
    bytes: int
    seconds: float
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "version": self.version, "bytes": self.bytes,
                "seconds": self.seconds, "crc32": self.crc32}

    @classmethod
    def from_json(cls, doc: object) -> PersistAnswer:
        f = _Fields(doc, "/persist answer")
        return cls(f.string("key"), f.integer("version", 0), f.integer("bytes", 0),
                   f.number("seconds"), f.integer("crc32"))


@dataclass(frozen=True)
class CommitRequest:
    """POST /commit: verify every rank's object of `version`, write the marker, prune."""

    version: int

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version}

    @classmethod
    def from_json(cls, doc: object) -> CommitRequest:
        return cls(_Fields(doc, "/commit body").integer("version", 0))


@dataclass(frozen=True)
class CommitAnswer:
    marker: str
    version: int
    deleted_steps: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"marker": self.marker, "version": self.version,
                "deleted_steps": list(self.deleted_steps)}

    @classmethod
    def from_json(cls, doc: object) -> CommitAnswer:
        f = _Fields(doc, "/commit answer")
        return cls(f.string("marker"), f.integer("version", 0),
                   f.ranks("deleted_steps", required=True, what="steps"))


@dataclass(frozen=True)
class RestoreRequest:
    """POST /restore: download the own rank of committed step `version` (None: the newest
    committed) into shared memory."""

    version: int | None = None
    wait_seconds: float | None = None  # rule 7

    def to_json(self) -> dict[str, Any]:
        return _with_wait({"version": self.version}, self.wait_seconds)

    @classmethod
    def from_json(cls, doc: object) -> RestoreRequest:
        f = _Fields(doc, "/restore body")
        return cls(f.opt_integer("version", 0), _wait_of(f))


@dataclass(frozen=True)
class RestoreAnswer:
    version: int
    bytes: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "bytes": self.bytes, "seconds": self.seconds}

    @classmethod
    def from_json(cls, doc: object) -> RestoreAnswer:
        f = _Fields(doc, "/restore answer")
        return cls(f.integer("version", 0), f.integer("bytes", 0), f.number("seconds"))


@dataclass(frozen=True)
class CommittedStepsAnswer:
    """GET /committed-steps: the steps committed to S3 by this job (its namespace, name and
    uid), oldest first. The sidecars hold the S3 credentials, so the operator asks them."""

    steps: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"steps": list(self.steps)}

    @classmethod
    def from_json(cls, doc: object) -> CommittedStepsAnswer:
        return cls(_Fields(doc, "/committed-steps answer").ranks("steps", required=True,
                                                                 what="steps"))


@dataclass(frozen=True)
class TransferRunning:
    """A transfer still under way (rule 7), answered with 202: bytes done of the total
    (None until the source said how many), and seconds since it started."""

    kind: str  # one of TRANSFER_KINDS
    rank: int | None  # the rank moved (None: every held rank, /fetch-replicas)
    version: int | None
    done_bytes: int
    total_bytes: int | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"state": "running", "kind": self.kind, "rank": self.rank,
                "version": self.version, "done_bytes": self.done_bytes,
                "total_bytes": self.total_bytes, "seconds": self.seconds}

    @classmethod
    def from_json(cls, doc: object) -> TransferRunning:
        f = _Fields(doc, "transfer answer (202)")
        kind = f.string("kind")
        if kind not in TRANSFER_KINDS:
            raise f.fail("kind", f"one of {', '.join(TRANSFER_KINDS)}", kind)
        return cls(kind, f.opt_integer("rank", 0), f.opt_integer("version", 0),
                   f.integer("done_bytes", 0), f.opt_integer("total_bytes", 0),
                   f.number("seconds"))

    def words(self) -> str:
        """'1.2 of 4.0 GiB in 3.1 s' (for events and waits)."""
        gib = 1 << 30
        total = "?" if self.total_bytes is None else f"{self.total_bytes / gib:.2f}"
        return f"{self.done_bytes / gib:.2f} of {total} GiB in {self.seconds:.1f} s"


# -- the launcher ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RestartRequest:
    """POST /restart: run the training again as `epoch`, restoring `version` (a step,
    "latest", or None: a fresh start) from `source`; `env` is merged into its environment
    (e.g. this epoch's MASTER_ADDR/MASTER_PORT). See rule 6 of the module docstring."""

    epoch: int
    version: int | str | None = None
    source: str = "local"
    env: Mapping[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"epoch": self.epoch, "version": self.version,
                               "source": self.source}
        if self.env is not None:
            doc["env"] = dict(self.env)
        return doc

    @classmethod
    def from_json(cls, doc: object) -> RestartRequest:
        f = _Fields(doc, "/restart body")
        version = f.raw("version")
        if not (version is None or version == "latest" or (_is_int(version) and version >= 0)):
            raise f.fail("version", 'a step number, "latest" or null', version)
        source = f.raw("source")
        source = "local" if source is None else source
        if source not in RESTORE_SOURCES:
            raise f.fail("source", f"one of {', '.join(RESTORE_SOURCES)}", source)
        return cls(f.integer("epoch", 0), version, source, _restart_env(f))


def _restart_env(f: _Fields) -> dict[str, str] | None:
    env = f.raw("env")
    if env is None:
        return None
    if not isinstance(env, dict) or len(env) > MAX_RESTART_ENV or not all(
        isinstance(k, str) and k and "=" not in k and "\0" not in k
        and isinstance(v, str) and "\0" not in v for k, v in env.items()
    ):
        raise f.fail("env", f"an object of at most {MAX_RESTART_ENV} names (no '=') to "
                            "string values", env)
    return dict(env)


@dataclass(frozen=True)
class StandbyState:
    """The warm standby interpreter prepared for the next run."""

    pid: int
    ready: bool

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "ready": self.ready}


@dataclass(frozen=True)
class RestoreOrder:
    """What the current run was told to restore (a version from the environment is text)."""

    version: int | str | None
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source}


@dataclass(frozen=True)
class Progress:
    """The training's last heartbeat: its step, its unix time, and its age in seconds."""

    step: int
    unix: float
    age_s: float

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "unix": self.unix, "age_s": self.age_s}


@dataclass(frozen=True)
class FailureHint:
    """POST /v1/hints/failure, to the operator, by a launcher whose training just failed
    (exited or parked), with the job token: "poll my job now". The operator still learns what
    failed from its own poll; the hint only ends the wait for it, so a forged one costs no more
    than a poll of the sender's own job."""

    namespace: str
    job: str
    uid: str
    rank: int
    epoch: int

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "job": self.job, "uid": self.uid,
                "rank": self.rank, "epoch": self.epoch}

    @classmethod
    def from_json(cls, doc: object) -> FailureHint:
        f = _Fields(doc, "/v1/hints/failure body")
        return cls(namespace=f.string("namespace"), job=f.string("job"), uid=f.string("uid"),
                   rank=f.integer("rank", 0), epoch=f.integer("epoch", 0))


@dataclass(frozen=True)
class HintAnswer:
    polling: bool  # False: the job was polled moments ago, or is polled already

    def to_json(self) -> dict[str, Any]:
        return {"polling": self.polling}

    @classmethod
    def from_json(cls, doc: object) -> HintAnswer:
        return cls(_Fields(doc, "/v1/hints/failure answer").boolean("polling"))


@dataclass(frozen=True)
class LauncherStatus:
    """GET /status (also the answer of POST /stop, and the launcher's status file)."""

    state: str  # one of LAUNCHER_STATES
    pid: int | None
    epoch: int
    restarts: int
    exit_code: int | None
    exited_at: float | None
    started_at: float | None
    warm: bool
    standby: StandbyState | None
    restore: RestoreOrder
    progress: Progress | None
    port: int
    in_process: int = 0  # restarts a parked process took in place (gemini_trainer.inprocess)
    error: str | None = None  # while parked: what failed

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "pid": self.pid, "epoch": self.epoch,
                "restarts": self.restarts, "exit_code": self.exit_code,
                "exited_at": self.exited_at, "started_at": self.started_at, "warm": self.warm,
                "standby": None if self.standby is None else self.standby.to_json(),
                "restore": self.restore.to_json(),
                "progress": None if self.progress is None else self.progress.to_json(),
                "port": self.port, "in_process": self.in_process, "error": self.error}

    @classmethod
    def from_json(cls, doc: object, where: str = "/status answer") -> LauncherStatus:
        f = _Fields(doc, where)
        state = f.string("state")
        if state not in LAUNCHER_STATES:
            raise f.fail("state", f"one of {', '.join(LAUNCHER_STATES)}", state)
        return cls(state, f.opt_integer("pid"), f.integer("epoch", 0), f.integer("restarts", 0),
                   f.opt_integer("exit_code"), f.opt_number("exited_at"),
                   f.opt_number("started_at"), f.boolean("warm"), _standby(f), _restore(f),
                   _progress(f), f.integer("port", 0), f.integer("in_process", 0),
                   f.opt_string("error"))


def _standby(f: _Fields) -> StandbyState | None:
    s = f.opt_obj("standby")
    return None if s is None else StandbyState(s.integer("pid"), s.boolean("ready"))


def _restore(f: _Fields) -> RestoreOrder:
    r = f.obj("restore")
    version = r.raw("version")
    if not (version is None or isinstance(version, str) or _is_int(version)):
        raise r.fail("version", "a step number, a string or null", version)
    return RestoreOrder(version, r.string("source"))


def read_heartbeat(path: Path) -> Progress | None:
    """The last heartbeat in `path` ("<step> <unix time>", written by the trainer library);
    None when there is none yet or it cannot be read."""
    try:
        step_text, when_text = path.read_text().split()[:2]
        step, when = int(step_text), float(when_text)
    except (OSError, ValueError):
        return None
    return Progress(step, when, max(0.0, time.time() - when))


@dataclass(frozen=True)
class Parked:
    """An epoch whose training failed while its launcher stays up for the operator's next
    restart: written by the launcher next to the heartbeat, so the sidecar's /inventory
    carries it to the operator (no container restart shows it). ``exit_code`` None: the
    process is alive and waits for an in-process restart; else it exited with that code."""

    epoch: int
    error: str
    unix: float
    exit_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"epoch": self.epoch, "error": self.error, "unix": self.unix}
        if self.exit_code is not None:
            doc["exit_code"] = self.exit_code
        return doc

    @classmethod
    def read(cls, f: _Fields) -> Parked:
        return cls(f.integer("epoch"), f.string("error")[:PARKED_ERROR_CHARS], f.number("unix"),
                   f.opt_integer("exit_code"))


PARKED_ERROR_CHARS = 2000
# How a launcher's Parked.error begins when the kernel's OOM killer ended the training process
# (gemini_trainer.oom); the operator then reports the rank as OOMKilled.
OUT_OF_MEMORY = "out of memory:"


def parked_path(heartbeat: Path) -> Path:
    return heartbeat.with_name(heartbeat.name + ".parked")


def write_parked(path: Path, parked: Parked) -> None:
    write_atomically(path, json.dumps(parked.to_json()))


def write_atomically(path: Path, text: str) -> None:
    """Readers (the sidecar, a status reader) see the old file or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_parked(path: Path) -> Parked | None:
    """The parked marker in `path`; None when there is none or it cannot be read."""
    try:
        doc = json.loads(path.read_text()[: 4 * PARKED_ERROR_CHARS])
        return Parked.read(_Fields(doc, str(path)))
    except (OSError, ValueError):
        return None


def _parked(f: _Fields) -> Parked | None:
    p = f.opt_obj("parked")
    return None if p is None else Parked.read(p)


def _progress(f: _Fields) -> Progress | None:
    p = f.opt_obj("progress")
    return None if p is None else Progress(p.integer("step"), p.number("unix"),
                                           p.number("age_s"))


@dataclass(frozen=True)
class RestartAnswer:
    """POST /restart: "restarted", or "already" (that epoch runs), with the status after."""

    result: str  # one of RESTART_RESULTS
    status: LauncherStatus

    def to_json(self) -> dict[str, Any]:
        return {"result": self.result, **self.status.to_json()}

    @classmethod
    def from_json(cls, doc: object) -> RestartAnswer:
        f = _Fields(doc, "/restart answer")
        result = f.string("result")
        if result not in RESTART_RESULTS:
            raise f.fail("result", f"one of {', '.join(RESTART_RESULTS)}", result)
        return cls(result, LauncherStatus.from_json(doc, "/restart answer"))


# -- the client ------------------------------------------------------------------------------
# The peers a client calls (sidecars, launchers) run in images a job's author chooses, so an
# answer is taken only whole, in time, small and well formed; anything else is a ControlError.
DEFAULT_MAX_ANSWER_BYTES = 256 * 1024  # the largest real answer (an inventory) is a few KiB
MAX_ERROR_ANSWER_BYTES = 16 * 1024  # a refusal's {"error": ...} is a message, not data
MAX_JSON_DEPTH = 32  # real answers nest 4 deep
REFUSAL_LOG_SECONDS = 60.0  # repeats of one kind of refusal from one address: DEBUG only
_READ_BYTES = 64 * 1024
_MIN_REDACTED_TOKEN = 8
# Parsing amplifies: 256 KiB of "[]," become ~5 MiB of Python objects. One parse at a time
# (each holds the GIL anyway) bounds that to one answer's worth per process, however many
# calls are in flight.
_PARSE_LOCK = threading.Lock()
log = logging.getLogger(__name__)


class ControlError(RuntimeError):
    """A call that did not get a valid answer: the address, the path and the reason (what
    the server answered, or why nothing came back)."""

    def __init__(self, address: str, path: str, reason: str, status: int | None = None,
                 detail: str | None = None) -> None:
        super().__init__(f"{address}{path} {reason}")
        self.address, self.path, self.reason = address, path, reason
        self.status = status  # the HTTP status of a refusal (None: no answer or a bad one)
        self.detail = detail  # the refusal's ErrorAnswer text, when it sent one


def parse_json(raw: str | bytes | bytearray) -> object:
    """Strict JSON: ValueError (never RecursionError or a non-finite float) for anything but
    plain JSON with finite numbers, nested at most MAX_JSON_DEPTH deep."""
    try:
        doc = json.loads(raw, parse_float=_finite, parse_constant=_not_a_number)
    except RecursionError as err:  # the C scanner's own depth limit
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}") from err
    if _deeper_than(doc, MAX_JSON_DEPTH):
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}")
    return doc


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _not_a_number(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _deeper_than(doc: object, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep (walked without recursion, so
    the walk itself cannot overflow)."""
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = (value.values() if isinstance(value, dict)
                    else value if isinstance(value, list) else None)
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _json_object(doc: object) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ValueError(f"the answer must be a JSON object, got {_shown(doc)}")
    return doc


class _TooLarge(Exception):
    """An answer over the size a client takes."""


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


class DeadlineSocket:
    """A connected socket whose every send and receive ends by the call's deadline. A socket
    timeout alone bounds each read, and a peer sending a byte a second never trips it. The
    control client reads answers through it, the launcher's server requests."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def _arm(self) -> None:
        self._sock.settimeout(_left(self._deadline))

    def sendall(self, data: bytes) -> None:
        self._arm()
        self._sock.sendall(data)

    def recv_into(self, buffer: memoryview) -> int:
        self._arm()
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *_: object, **__: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        """Nothing: http.client closes its side before the body is read; the call closes the
        real socket once the answer is in."""


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: DeadlineSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)


def _read_capped(answer: http.client.HTTPResponse, limit: int) -> bytearray:
    """The answer's body, refused (_TooLarge) as soon as it is known to exceed `limit`: by its
    Content-Length before any of it is read, else once more than `limit` bytes came."""
    if answer.length is not None and answer.length > limit:
        raise _TooLarge(f"answered {answer.length} bytes, more than the {limit} it may")
    body = bytearray()
    while chunk := answer.read(min(_READ_BYTES, limit + 1 - len(body))):
        body += chunk
        if len(body) > limit:
            raise _TooLarge(f"answered more than the {limit} bytes it may")
    return body


class _RefusalLog:
    """Every answer a client refuses is logged once, with the peer's address and the reason:
    the first of its kind from an address in REFUSAL_LOG_SECONDS at WARNING, repeats at DEBUG
    (a hostile peer polled every 2 s must not flood the log)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}

    def note(self, address: str, path: str, kind: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            loud = now - self._last.get((address, kind), -math.inf) >= REFUSAL_LOG_SECONDS
            if loud:
                if len(self._last) > 4096:  # addresses come and go with pods
                    self._last = {k: t for k, t in self._last.items()
                                  if now - t < REFUSAL_LOG_SECONDS}
                self._last[(address, kind)] = now
        log.log(logging.WARNING if loud else logging.DEBUG,
                "refused the answer of %s%s (%s): %s", address, path, kind, reason)


_REFUSALS = _RefusalLog()


def control_digest(token: str) -> str:
    """What a pod is given to check the operator's control token by: its SHA-256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


CONTROL_DIGEST_ENV = "GEMINI_CONTROL_TOKEN_SHA256"


def control_digest_setting(env: Mapping[str, str]) -> str:
    """GEMINI_CONTROL_TOKEN_SHA256 (the sidecar's and the launcher's): empty, or 64 hex
    digits; ValueError saying so otherwise."""
    digest = env.get(CONTROL_DIGEST_ENV, "").strip().lower()
    if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
        raise ValueError(f"{CONTROL_DIGEST_ENV} must be 64 hex digits (the SHA-256 of the "
                         "operator's control token) or empty")
    return digest


def may_call(header: bytes, job_token: bytes, control_sha256: str, job_token_allowed: bool,
             ) -> bool:
    """Whether an `Authorization` header (raw bytes) may make a call.

    The operator's control token (its SHA-256 is `control_sha256`) may make any call. The job
    token, which every pod of the job holds, only those for which `job_token_allowed` (reads,
    and the trainer's own calls to its sidecar): so one pod cannot drive another's sidecar or
    launcher. Pods made before control tokens (`control_sha256` empty) take the job token
    for every call."""
    if control_sha256:
        token = header[len(b"Bearer "):] if header.startswith(b"Bearer ") else b""
        digest = hashlib.sha256(token).hexdigest().encode()
        if token and hmac.compare_digest(digest, control_sha256.encode()):
            return True
        if not job_token_allowed:
            return False
    return hmac.compare_digest(header, b"Bearer " + job_token)


@dataclass(frozen=True)
class Credentials:
    """The operator's bearer tokens for one job: its control token, and the job token to try
    when a pod made before control tokens refuses it (401)."""

    token: str
    fallback: str = ""


Bearer = str | Credentials  # what a ControlClient is given to authenticate with


class ControlClient:
    """One sidecar's or launcher's control API at ip:port (the caller picks the port). Every
    call returns the typed answer or raises ControlError within `timeout` seconds in all
    (connecting, sending and every byte of the answer), refusing an answer over
    `max_answer_bytes` before reading it all. Its errors never carry the token."""

    def __init__(self, ip: str, port: int, token: Bearer = "",
                 timeout: float = DEFAULT_TIMEOUT_SECONDS,
                 max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> None:
        self.address = f"{ip}:{port}"
        self._scheme, self._host, self._port, self._prefix = "http", ip, port, ""
        creds = token if isinstance(token, Credentials) else Credentials(token)
        self.token, self._fallback, self.timeout = creds.token, creds.fallback, timeout
        self.max_answer_bytes = max_answer_bytes

    @classmethod
    def for_url(cls, url: str, token: str = "",
                timeout: float = DEFAULT_TIMEOUT_SECONDS) -> ControlClient:
        """A client of the API at a base URL (the trainer is given its sidecar's URL)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the control API URL {url!r} is not http://host:port")
        default_port = 443 if parts.scheme == "https" else 80
        client = cls(parts.hostname, parts.port or default_port, token, timeout)
        client._scheme, client._prefix = parts.scheme, parts.path.rstrip("/")
        client.address = url.rstrip("/")
        return client

    # -- the sidecar ---------------------------------------------------------------------
    def healthz(self) -> Health:
        return self._typed(HEALTHZ_PATH, None, Health.from_json)

    def inventory(self) -> Inventory:
        return self._typed(INVENTORY_PATH, None, Inventory.from_json)

    def inventories(self, request: InventoriesRequest) -> InventoriesAnswer:
        """Size this client's answer cap with `relayed_answer_bytes`."""
        return self._typed(INVENTORIES_PATH, request.to_json(), InventoriesAnswer.from_json)

    def notify(self, request: NotifyRequest) -> NotifyAnswer:
        return self._typed(COMMITTED_PATH, request.to_json(), NotifyAnswer.from_json)

    def peers(self, request: Peers) -> Peers:
        return self._typed(PEERS_PATH, request.to_json(),
                           lambda doc: Peers.from_json(doc, "/peers answer"))

    def profile(self, request: ProfileRequest) -> ProfileAnswer:
        return self._typed(PROFILE_PATH, request.to_json(), ProfileAnswer.from_json)

    # The transfers (rule 7): TransferRunning when the request's wait_seconds passed first.
    def fetch(self, request: FetchRequest) -> FetchAnswer | TransferRunning:
        return self._transfer(FETCH_PATH, request.to_json(), FetchAnswer.from_json)

    def fetch_replicas(self, request: FetchReplicasRequest
                       ) -> FetchReplicasAnswer | TransferRunning:
        """Raises ControlError (status 502) when some held rank did not come."""
        return self._transfer(FETCH_REPLICAS_PATH, request.to_json(),
                              FetchReplicasAnswer.from_json)

    def persist(self, request: PersistRequest) -> PersistAnswer | TransferRunning:
        return self._transfer(PERSIST_PATH, request.to_json(), PersistAnswer.from_json)

    def commit(self, request: CommitRequest) -> CommitAnswer:
        return self._typed(COMMIT_PATH, request.to_json(), CommitAnswer.from_json)

    def restore(self, request: RestoreRequest) -> RestoreAnswer | TransferRunning:
        return self._transfer(RESTORE_PATH, request.to_json(), RestoreAnswer.from_json)

    def committed_steps(self) -> CommittedStepsAnswer:
        return self._typed(COMMITTED_STEPS_PATH, None, CommittedStepsAnswer.from_json)

    # -- the launcher --------------------------------------------------------------------
    def status(self) -> LauncherStatus:
        return self._typed(STATUS_PATH, None, LauncherStatus.from_json)

    def restart(self, request: RestartRequest) -> RestartAnswer:
        return self._typed(RESTART_PATH, request.to_json(), RestartAnswer.from_json)

    def stop(self) -> LauncherStatus:
        return self._typed(STOP_PATH, {},
                           lambda doc: LauncherStatus.from_json(doc, "/stop answer"))

    # -- the operator's hint server -----------------------------------------------------
    def failure_hint(self, hint: FailureHint) -> HintAnswer:
        return self._typed(FAILURE_HINT_PATH, hint.to_json(), HintAnswer.from_json)

    # -- any call ------------------------------------------------------------------------
    def call_json(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """GET `path` (no body) or POST the body; the answer's JSON object (any other JSON
        value is refused)."""
        return self._typed(path, body, _json_object)

    def _typed(self, path: str, body: Mapping[str, Any] | None,
               parse: Callable[[object], T]) -> T:
        status, raw = self._exchange(path, body)
        return self._parsed(path, status, raw, parse)

    def _transfer(self, path: str, body: Mapping[str, Any] | None,
                  parse: Callable[[object], T]) -> T | TransferRunning:
        status, raw = self._exchange(path, body)
        if status == 202:
            return self._parsed(path, status, raw, TransferRunning.from_json)
        return self._parsed(path, status, raw, parse)

    def _parsed(self, path: str, status: int, raw: bytearray,
                parse: Callable[[object], T]) -> T:
        if not 200 <= status < 300:
            raise self._refused(path, status, raw)
        with _PARSE_LOCK:
            try:
                doc = parse_json(raw or b"{}")
            except ValueError as err:
                raise self._refusal(path, "not JSON",
                                    f"answered a body that is not JSON ({err})") from err
            try:
                return parse(doc)
            # The readers raise ValueError; anything else an untrusted body provokes in one
            # is still that body's fault, and must reach the caller as a ControlError.
            except (ValueError, TypeError, LookupError) as err:
                raise self._refusal(path, "unexpected body",
                                    f"answered an unexpected body: {err}") from err

    def _exchange(self, path: str, body: Mapping[str, Any] | None) -> tuple[int, bytearray]:
        """Send the request and read the whole answer by the deadline: (status, body); a
        401 is asked again once with the fallback token (a pod older than control tokens)."""
        status, raw = self._exchange_once(path, body)
        if status == 401 and self._fallback:
            self.token, self._fallback = self._fallback, ""
            status, raw = self._exchange_once(path, body)
        return status, raw

    def _exchange_once(self, path: str, body: Mapping[str, Any] | None
                       ) -> tuple[int, bytearray]:
        deadline = time.monotonic() + self.timeout
        connection = http.client.HTTPSConnection if self._scheme == "https" else (
            http.client.HTTPConnection)
        conn = connection(self._host, self._port, timeout=self.timeout)
        connected: socket.socket | None = None
        try:
            conn.connect()
            connected = conn.sock
            conn.sock = DeadlineSocket(connected, deadline)  # type: ignore[assignment]
            self._send(conn, path, body)
            with conn.getresponse() as answer:
                ok = 200 <= answer.status < 300
                limit = self.max_answer_bytes if ok else MAX_ERROR_ANSWER_BYTES
                return answer.status, _read_capped(answer, limit)
        except _TooLarge as err:
            raise self._refusal(path, "too large", str(err)) from err
        except TimeoutError as err:
            if connected is None:  # no connection at all: a silent address, as before
                raise self._error(path, f"unreachable ({err})") from err
            raise self._refusal(path, "deadline", f"unreachable (no whole answer within "
                                                  f"{self.timeout:g} s)") from err
        except (OSError, http.client.HTTPException) as err:
            raise self._error(path, f"unreachable ({err})") from err
        finally:
            conn.close()
            if connected is not None:
                connected.close()

    def _send(self, conn: http.client.HTTPConnection, path: str,
              body: Mapping[str, Any] | None) -> None:
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        conn.request("GET" if body is None else "POST", self._prefix + path, data, headers)

    def _refused(self, path: str, status: int, raw: bytearray) -> ControlError:
        """The server's refusal (a status other than 2xx), with its ErrorAnswer when sent."""
        try:
            detail: str | None = ErrorAnswer.from_json(parse_json(raw)).error
        except ValueError:
            detail = None
        return self._error(path, f"answered {status} {bytes(raw[:300])!r}", status, detail)

    def _refusal(self, path: str, kind: str, reason: str) -> ControlError:
        """An answer this client does not take: logged once, and raised."""
        error = self._error(path, reason)
        _REFUSALS.note(self.address, path, kind, error.reason)
        return error

    def _error(self, path: str, reason: str, status: int | None = None,
               detail: str | None = None) -> ControlError:
        """A ControlError without the token in its text: a peer may echo it back."""
        return ControlError(self.address, path, self._redacted(reason), status,
                            None if detail is None else self._redacted(detail))

    def _redacted(self, text: str) -> str:
        # Job tokens are 43 random characters; a short test token would blank out words.
        secret = len(self.token) >= _MIN_REDACTED_TOKEN
        return text.replace(self.token, "<token>") if secret else text
