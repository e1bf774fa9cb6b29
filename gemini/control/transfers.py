"""The transfers' messages: fetch from peers (``/fetch``, ``/fetch-replicas``), S3
(``/persist``, ``/commit``, ``/restore``, ``/committed-steps``), and the 202 answer of a
transfer still running (rule 7 of gemini.control.paths)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gemini.control.strict import Fields, Holder

FETCH_TARGETS = ("shm", "store")
TRANSFER_KINDS = ("fetch", "fetch-replicas", "persist", "restore")
MAX_WAIT_SECONDS = 60.0  # a transfer request's wait_seconds: longer would hold the call open


def _wait_of(f: Fields) -> float | None:
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
        f = Fields(doc, "/fetch body")
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
        f = Fields(doc, "/fetch answer")
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
        f = Fields(doc, "/fetch-replicas body")
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
    def read(cls, f: Fields) -> ReplicaFetch:
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
        f = Fields(doc, "/fetch-replicas answer")
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
        f = Fields(doc, "/persist body")
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
        f = Fields(doc, "/persist answer")
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
        return cls(Fields(doc, "/commit body").integer("version", 0))


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
        f = Fields(doc, "/commit answer")
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
        f = Fields(doc, "/restore body")
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
        f = Fields(doc, "/restore answer")
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
        return cls(Fields(doc, "/committed-steps answer").ranks("steps", required=True,
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
        f = Fields(doc, "transfer answer (202)")
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
