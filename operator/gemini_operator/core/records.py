"""Typed status records of training and recovery: status.launch, status.recovery and its plan,
status.placement, status.lastRecovery and status.spares.

Each record reads and writes exactly the JSON the CRD's status schema describes (the kubectl
plugin and a restarted operator read it). The plan is built from the domain's RecoveryPlan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from gemini.control.strict import Fields, is_int
from gemini.domain.placement import Placement
from gemini.domain.recovery import MODE_S3, RankSource, RecoveryPlan
from gemini_operator.core.apitime import parse_api_time

MODE_FRESH = "fresh"  # nothing to restore (training never started or never checkpointed)
RESUME = "resume"  # status.recovery.kind and lastRecovery.cause of a resume after suspend
RECOVERY_SOURCES = ("Local", "Peers", "S3")  # lastRecovery.source (PlanRecord.source_word)
# The breakdown entry of a recovery planned again: the time before the new plan began.
SUPERSEDED = "superseded"


class RecoveryPhase(StrEnum):
    """The steps of a recovery, in order; each is recorded before it acts."""

    PLANNING = "Planning"
    REPLACING = "Replacing"
    FETCHING = "Fetching"
    RESTARTING = "Restarting"


@dataclass(frozen=True)
class LaunchRecord:
    """status.launch: the epoch the launchers run, its rendezvous, and each rank's trainer
    container restarts and pod UID at that time (a later restart is a failure)."""

    epoch: int
    restart_attempt: int
    master_addr: str | None = None
    master_port: int | None = None
    trainer_restarts: Mapping[int, int] = field(default_factory=dict)
    pod_uids: Mapping[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"epoch": self.epoch, "restartAttempt": self.restart_attempt}
        if self.master_addr is not None:
            out["masterAddr"] = self.master_addr
        if self.master_port is not None:
            out["masterPort"] = self.master_port
        out["trainerRestarts"] = {str(r): n for r, n in sorted(self.trainer_restarts.items())}
        out["podUIDs"] = {str(r): uid for r, uid in sorted(self.pod_uids.items())}
        return out

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> LaunchRecord:
        port = raw.get("masterPort")
        return LaunchRecord(
            epoch=int(raw.get("epoch", 0)),
            restart_attempt=int(raw.get("restartAttempt", -1)),
            master_addr=raw.get("masterAddr"),
            master_port=None if port is None else int(port),
            trainer_restarts={int(r): int(n) for r, n in
                              (raw.get("trainerRestarts") or {}).items()},
            pod_uids={int(r): str(uid) for r, uid in (raw.get("podUIDs") or {}).items()},
        )


@dataclass(frozen=True)
class PlanRecord:
    """status.recovery.plan: the version every rank restores and from where."""

    version: int | None
    mode: str
    reason: str
    replace_ranks: tuple[int, ...] = ()
    sources: Mapping[int, RankSource] = field(default_factory=dict)
    refetch: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    newest_seen: int | None = None  # the newest step any sidecar held (steps lost = it - version)

    @staticmethod
    def from_plan(plan: RecoveryPlan, newest_seen: int | None) -> PlanRecord:
        # The status keeps where each rank loads from, not the checksums.
        sources = {r: RankSource(s.kind, s.holder) for r, s in plan.sources.items()}
        return PlanRecord(plan.version, plan.mode, plan.reason, plan.replace_ranks, sources,
                          dict(plan.refetch), newest_seen)

    @property
    def source_word(self) -> str:
        """lastRecovery.source: S3, Peers (some rank loaded from a peer) or Local."""
        local, peers, s3 = RECOVERY_SOURCES
        if self.mode == MODE_S3:
            return s3
        return peers if self.peer_sources() else local

    def peer_sources(self) -> dict[int, int]:
        """rank -> the peer it loads its shard from, for the ranks that load from a peer."""
        return {r: s.holder for r, s in self.sources.items()
                if s.kind == "peer" and s.holder is not None}

    @property
    def steps_lost(self) -> int:
        if self.newest_seen is None or self.version is None:
            return 0
        return max(0, self.newest_seen - self.version)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "mode": self.mode,
            "reason": self.reason,
            "replaceRanks": list(self.replace_ranks),
            "sources": {str(r): {"kind": s.kind, "holder": s.holder}
                        for r, s in sorted(self.sources.items())},
            "refetch": {str(r): list(h) for r, h in sorted(self.refetch.items())},
            "newestSeen": self.newest_seen,
        }

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> PlanRecord:
        version, newest = raw.get("version"), raw.get("newestSeen")
        return PlanRecord(
            version=None if version is None else int(version),
            mode=str(raw.get("mode", "")),
            reason=str(raw.get("reason", "")),
            replace_ranks=tuple(int(r) for r in raw.get("replaceRanks") or ()),
            sources={int(r): _source(s) for r, s in (raw.get("sources") or {}).items()},
            refetch={int(r): tuple(int(h) for h in hs)
                     for r, hs in (raw.get("refetch") or {}).items()},
            newest_seen=None if newest is None else int(newest),
        )


def _source(raw: Mapping[str, Any]) -> RankSource:
    holder = raw.get("holder")
    return RankSource(raw.get("kind", "local"), None if holder is None else int(holder))


@dataclass(frozen=True)
class RecoveryRecord:
    """status.recovery: the recovery (or resume) under way, each phase written before it acts.

    `lost_ranks` (stored as plan.lostRanks) are known before planning; `plan` is None until
    the Planning phase has planned."""

    epoch: int
    phase: RecoveryPhase
    kind: str  # a FailureKind value, or RESUME
    cause: str = ""
    failed_ranks: tuple[int, ...] = ()
    detected_at: str | None = None
    started_at: str | None = None
    started_unix: float = 0.0  # the clock's time at the start, for durations
    marks: Mapping[str, float] = field(default_factory=dict)  # cumulative seconds per phase
    lost_ranks: tuple[int, ...] = ()
    plan: PlanRecord | None = None

    def at(self, phase: RecoveryPhase, now_unix: float,
           plan: PlanRecord | None = None) -> RecoveryRecord:
        """This record moved on to `phase`, with the time the current phase ended marked."""
        marks = {**self.marks, self.phase.value.lower(): round(now_unix - self.started_unix, 3)}
        return replace(self, phase=phase, marks=marks, plan=plan or self.plan)

    def superseded_marks(self, now_unix: float) -> dict[str, float]:
        """The marks of this recovery planned again (a rank was newly lost): the time so far
        went into a plan the loss superseded, and the phases are timed afresh from here."""
        return {SUPERSEDED: round(now_unix - self.started_unix, 3)}

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan.to_dict() if self.plan is not None else {}
        return {
            "epoch": self.epoch,
            "phase": self.phase.value,
            "kind": self.kind,
            "cause": self.cause,
            "failedRanks": list(self.failed_ranks),
            "detectedAt": self.detected_at,
            "startedAt": self.started_at,
            "startedUnix": self.started_unix,
            "marks": dict(self.marks),
            "plan": {**plan, "lostRanks": list(self.lost_ranks)},
        }

    @staticmethod
    def started_timestamp(raw: Mapping[str, Any]) -> float | None:
        """Unix time the stored recovery `raw` started: startedUnix, else (a record written
        before it was kept) startedAt; None when neither is known. Reads only those two
        fields, so that the metrics never fail a reconcile over the rest of the record."""
        if unix := raw.get("startedUnix"):
            return float(unix)
        at = parse_api_time(raw.get("startedAt"))
        return None if at is None else at.timestamp()

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> RecoveryRecord:
        plan = raw.get("plan") or {}
        return RecoveryRecord(
            epoch=int(raw.get("epoch", 0)),
            phase=RecoveryPhase(raw.get("phase", RecoveryPhase.PLANNING.value)),
            kind=str(raw.get("kind", "software")),
            cause=str(raw.get("cause", "")),
            failed_ranks=tuple(int(r) for r in raw.get("failedRanks") or ()),
            detected_at=raw.get("detectedAt"),
            started_at=raw.get("startedAt"),
            started_unix=float(raw.get("startedUnix", 0.0)),
            marks={str(k): float(v) for k, v in (raw.get("marks") or {}).items()},
            lost_ranks=tuple(int(r) for r in plan.get("lostRanks") or ()),
            plan=PlanRecord.from_dict(plan) if "mode" in plan else None,
        )


@dataclass(frozen=True)
class PlacementRecord:
    """status.placement: who holds each rank's shard (`layout`), published for one attempt,
    and the node each rank was on when it was computed (a rank that moves gets a new one)."""

    layout: Placement
    restart_attempt: int
    nodes: Mapping[int, str]

    def on(self, nodes: Mapping[int, str]) -> bool:
        """Whether the ranks are still on the nodes this placement was computed for."""
        return dict(self.nodes) == dict(nodes)

    def moved_to(self, nodes: Mapping[int, str]) -> PlacementRecord:
        """The same holders, the ranks now on `nodes` (replacements took over their shards)."""
        return replace(self, nodes=dict(nodes))

    def to_json(self) -> dict[str, Any]:
        return {**self.layout.to_dict(), "restartAttempt": self.restart_attempt,
                "nodes": {str(r): node for r, node in sorted(self.nodes.items())}}

    @classmethod
    def from_json(cls, doc: object) -> PlacementRecord:
        f = Fields(doc, "status.placement")
        layout = Placement(
            replicas=f.integer("replicas", 1),
            groups=tuple(_rank_list(f, "groups", g) for g in _list(f, "groups")),
            holders={r: _rank_list(f, f"holders.{r}", h) for r, h in f.by_rank("holders").items()},
            strategy=f.string("strategy"), reason=f.opt_string("reason") or "")
        nodes = f.by_rank("nodes")
        for rank, node in nodes.items():
            if not isinstance(node, str):
                raise f.fail(f"nodes.{rank}", "a node name", node)
        return cls(layout, f.integer("restartAttempt", 0), nodes)


def _list(f: Fields, key: str) -> list[Any]:
    value = f.raw(key)
    if not isinstance(value, list):
        raise f.fail(key, "a list", value)
    return value


def _rank_list(f: Fields, name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(is_int(r) and r >= 0 for r in value):
        raise f.fail(name, "a list of ranks (integers >= 0)", value)
    return tuple(value)


@dataclass(frozen=True)
class LastRecovery:
    """status.lastRecovery: how the last recovery (or resume) went, kept until the next."""

    cause: str  # a FailureKind value, or RESUME
    message: str
    source: str  # PlanRecord.source_word
    failed_ranks: tuple[int, ...]
    steps_lost: int
    start_time: str | None
    detected_at: str | None
    completion_time: str
    duration_seconds: float  # rounded to milliseconds
    duration_milliseconds: int  # truncated
    epoch: int
    breakdown: Mapping[str, float]  # seconds spent in each phase
    restored_step: int | None = None  # None: a fresh start

    @property
    def restored(self) -> int | str:
        """The step restored, as the RecoveryFinished condition words it."""
        return "none (fresh start)" if self.restored_step is None else self.restored_step

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "cause": self.cause, "message": self.message, "source": self.source,
            "failedRanks": list(self.failed_ranks), "stepsLost": self.steps_lost,
            "startTime": self.start_time, "detectedAt": self.detected_at,
            "completionTime": self.completion_time,
            "durationSeconds": self.duration_seconds,
            "durationMilliseconds": self.duration_milliseconds,
            "epoch": self.epoch, "breakdown": dict(self.breakdown),
        }
        if self.restored_step is not None:
            doc["restoredStep"] = self.restored_step
        return doc

    @classmethod
    def from_json(cls, doc: object) -> LastRecovery:
        f = Fields(doc, "status.lastRecovery")
        breakdown = f.obj("breakdown")
        return cls(
            cause=f.string("cause"), message=f.string("message"), source=f.string("source"),
            failed_ranks=f.ranks("failedRanks"), steps_lost=f.integer("stepsLost", 0),
            start_time=f.opt_string("startTime"), detected_at=f.opt_string("detectedAt"),
            completion_time=f.string("completionTime"),
            duration_seconds=f.number("durationSeconds"),
            duration_milliseconds=f.integer("durationMilliseconds", 0), epoch=f.integer("epoch", 0),
            breakdown={phase: breakdown.number(phase) for phase in f.raw("breakdown")},
            restored_step=f.opt_integer("restoredStep"))


@dataclass(frozen=True)
class SparesRecord:
    """status.spares: how many spare nodes are wanted and held, which, and why not all."""

    desired: int
    ready: int  # placeholders running on Ready nodes
    nodes: tuple[str, ...]  # the nodes those hold
    reason: str  # Held, Creating or NoFreeNode
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"desired": self.desired, "ready": self.ready, "nodes": list(self.nodes),
                "reason": self.reason, "message": self.message}

    @classmethod
    def from_json(cls, doc: object) -> SparesRecord:
        f = Fields(doc, "status.spares")
        return cls(f.integer("desired", 0), f.integer("ready", 0), f.strings("nodes"),
                   f.string("reason"), f.string("message"))
