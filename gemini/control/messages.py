"""The small messages of the sidecar's API: the error answer (of both APIs), health, the
trainer's notify, the placement (``Peers``) and the traffic profile. Frozen dataclasses with
``to_json`` and ``from_json``; the field names are the wire names (see gemini.control.strict
for how they are read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemini.control.strict import Fields, is_address, is_digits, is_number, parse_json

# -- the error answer and health ---------------------------------------------------------------

@dataclass(frozen=True)
class ErrorAnswer:
    """What every refusal carries, with a 4xx/5xx status: what to fix."""

    error: str

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error}

    @classmethod
    def from_json(cls, doc: object) -> ErrorAnswer:
        return cls(Fields(doc, "error answer").string("error"))


@dataclass(frozen=True)
class Health:
    """GET /healthz."""

    status: str = "ok"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status}

    @classmethod
    def from_json(cls, doc: object) -> Health:
        return cls(Fields(doc, "/healthz answer").string("status"))


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
        f = Fields(doc, "/notify body")
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
        return cls(Fields(doc, "/notify answer").integer("accepted"))


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
        return cls.read(Fields(doc, where))

    @classmethod
    def read(cls, f: Fields) -> Peers:
        return cls(_peer_map(f), f.ranks("hold_ranks"), f.ranks("send_to"))

    def same_ranks(self, other: Peers) -> bool:
        """Whether both hold and send to the same ranks (order and addresses aside): a
        sidecar whose inventory placement differs from the delivered one needs it again."""
        return (set(self.hold_ranks) == set(other.hold_ranks)
                and set(self.send_to) == set(other.send_to))


def _peer_map(f: Fields) -> dict[int, str]:
    """`peers`: an object of rank -> "host:port", or the environment's "0=host:port,..."."""
    raw = f.raw("peers")
    if isinstance(raw, str):
        return _peer_text(f, raw)
    peers = f.by_rank("peers", required=False)
    for rank, address in peers.items():
        if not is_address(address):
            raise f.fail(f"peers.{rank}", '"host:port"', address)
    return peers


def _peer_text(f: Fields, text: str) -> dict[int, str]:
    if text.strip().startswith("{"):
        try:
            doc = parse_json(text)  # a peer's text: strict, like every answer
        except ValueError as err:
            raise f.fail("peers", "an object of rank -> host:port", text) from err
        return _peer_map(Fields({"peers": doc}, f.where, f.path))
    out: dict[int, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        rank, sep, address = item.partition("=")
        if not sep or not is_digits(rank.strip()) or not is_address(address):
            raise f.fail("peers", 'entries "rank=host:port"', item)
        out[int(rank)] = address.strip()
    return out


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
        f = Fields(doc, "/profile body")
        iterations = tuple(_iteration(it) for it in f.objects("iterations"))
        if not iterations:
            raise ValueError("/profile body: 'iterations' must not be empty")
        return cls(iterations)


def _iteration(f: Fields) -> ProfileIteration:
    ops = f.raw("ops")
    if not isinstance(ops, list) or not all(
            isinstance(op, list) and len(op) == 2 and all(is_number(x) for x in op)
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
        return cls(Fields(doc, "/profile answer").integer("iterations", 0))
