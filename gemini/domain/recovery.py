"""Recovery planning: from what failed and what the surviving memory holds, to a plan.

A pure function of the replica count, the placement, the failed ranks, the holders whose
memory is gone and the inventory that live sidecars report, plus the versions committed in S3.
The plan restores the newest version that is complete for every rank in surviving memory (or
in S3 when that is newer or memory cannot cover every rank) and never mixes versions between
ranks, because synchronous training must resume every rank from the same iteration.

Holder ids are ranks: rank r's sidecar holds rank r's own shard and its peers' replicas.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Literal

from gemini.domain.placement import Placement

MODE_MEMORY = "memory"
MODE_S3 = "s3"
MODE_UNRECOVERABLE = "unrecoverable"

SourceKind = Literal["local", "peer", "s3"]


class RecoveryPlanError(ValueError):
    """The inputs contradict each other (unknown ranks, replica count unlike the placement)."""


class FailureKind(Enum):
    """What went wrong with a rank; decides whether it needs a replacement pod."""

    SOFTWARE = "software"  # the training process died on a live pod: restart it in place
    HARDWARE = "hardware"  # the pod or its node is gone: memory lost, replace the pod
    HANG = "hang"  # alive but no training progress: kill and restart in place

    @property
    def needs_replacement(self) -> bool:
        return self is FailureKind.HARDWARE


def classify_failure(
    *,
    pod_lost: bool = False,
    node_lost: bool = False,
    process_exited: bool = False,
    seconds_without_progress: float = 0.0,
    hang_timeout_seconds: float = 300.0,
) -> FailureKind | None:
    """Classify one rank's observed state; None when it is healthy.

    A lost pod or node outranks everything else, since the rank's memory went with it; a crash
    on a live pod is a software failure; otherwise a rank that made no progress for longer than
    the hang timeout is hung. Time is passed in, never read here.
    """
    if pod_lost or node_lost:
        return FailureKind.HARDWARE
    if process_exited:
        return FailureKind.SOFTWARE
    if seconds_without_progress > hang_timeout_seconds:
        return FailureKind.HANG
    return None


def worst_failure(kinds: Iterable[FailureKind | None]) -> FailureKind | None:
    """The job-level kind: hardware if any rank lost its pod, else software, else hang."""
    present = {k for k in kinds if k is not None}
    for kind in (FailureKind.HARDWARE, FailureKind.SOFTWARE, FailureKind.HANG):
        if kind in present:
            return kind
    return None


@dataclass(frozen=True, slots=True)
class ShardCopy:
    """One entry of a sidecar's inventory: holder `holder` has rank `rank`'s shard at `version`."""

    rank: int
    version: int
    holder: int
    complete: bool
    checksum: str


@dataclass(frozen=True, slots=True)
class RankSource:
    """Where a rank loads its shard from: its own memory, a peer holder's memory, or S3."""

    kind: SourceKind
    holder: int | None = None  # the rank whose sidecar serves it (None for S3)
    checksum: str | None = None  # what the loaded bytes must hash to, when known

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "holder": self.holder, "checksum": self.checksum}


@dataclass(frozen=True)
class RecoveryPlan:
    """The decision. In "memory" and "s3" mode every rank has a source, all at `version`.

    `replace_ranks` need replacement pods (their memory is gone); `refetch[r]` lists the ranks
    whose replicas the replacement for r must fetch again (from `replica_source`) so that every
    shard has m copies again. "unrecoverable" has no sources and says why in `reason`.
    """

    version: int | None
    mode: str
    sources: Mapping[int, RankSource]
    replace_ranks: tuple[int, ...]
    refetch: Mapping[int, tuple[int, ...]]
    reason: str
    restart_ranks: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "refetch", MappingProxyType(dict(self.refetch)))

    @property
    def recoverable(self) -> bool:
        return self.mode != MODE_UNRECOVERABLE

    def replica_source(self, rank: int) -> int | None:
        """The holder to fetch rank `rank`'s replica from at `version` (None: from S3)."""
        source = self.sources[rank]
        return rank if source.kind == "local" else source.holder

    def peer_fetches(self) -> Counter[int]:
        """How many shards each holder serves to others (for spotting a hot peer)."""
        return Counter(
            s.holder for s in self.sources.values() if s.kind == "peer" and s.holder is not None
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "mode": self.mode,
            "reason": self.reason,
            "sources": {str(r): s.to_dict() for r, s in self.sources.items()},
            "replaceRanks": list(self.replace_ranks),
            "restartRanks": list(self.restart_ranks),
            "refetch": {str(r): list(v) for r, v in self.refetch.items()},
        }


def plan_recovery(
    replicas: int,
    placement: Placement,
    failed_ranks: Iterable[int],
    lost_holders: Iterable[int],
    inventory: Sequence[ShardCopy],
    s3_versions: Sequence[int],
) -> RecoveryPlan:
    """Decide which version every rank restores and from where.

    `failed_ranks` are ranks whose training failed (any kind); `lost_holders` are ranks whose
    pod or node is gone, so their memory is lost and they get replacement pods. Inventory
    entries from lost holders are ignored. Every rank restarts its training process (the job
    is synchronous), so `restart_ranks` is every rank.
    """
    failed, lost = _check_inputs(replicas, placement, failed_ranks, lost_holders)
    ranks = placement.ranks
    usable = _usable_copies(inventory, lost, placement)
    memory_version, missing = _newest_complete(usable, len(ranks))
    newest_s3 = max(s3_versions, default=None)
    replace = tuple(sorted(lost))
    if memory_version is not None and (newest_s3 is None or memory_version >= newest_s3):
        sources = _memory_sources(ranks, usable[memory_version], lost, placement)
        refetch = {r: placement.receives_from(r) for r in replace if placement.receives_from(r)}
        reason = _memory_reason(memory_version, sources, failed, replace)
        return RecoveryPlan(memory_version, MODE_MEMORY, sources, replace, refetch, reason, ranks)
    if newest_s3 is not None:
        s3 = RankSource("s3")
        reason = _s3_reason(newest_s3, memory_version, missing, usable, ranks)
        return RecoveryPlan(
            newest_s3, MODE_S3, dict.fromkeys(ranks, s3), replace, {}, reason, ranks
        )
    return RecoveryPlan(
        None, MODE_UNRECOVERABLE, {}, replace, {}, _unrecoverable_reason(missing, usable, ranks), ()
    )


# version -> rank -> the usable complete copies (checksum-consistent) of that rank's shard
_Copies = dict[int, dict[int, list[ShardCopy]]]


def _check_inputs(
    replicas: int, placement: Placement, failed_ranks: Iterable[int], lost_holders: Iterable[int]
) -> tuple[frozenset[int], frozenset[int]]:
    if replicas != placement.replicas:
        raise RecoveryPlanError(
            f"replicas={replicas} but the placement was made for m={placement.replicas}; "
            "plan with the placement the job runs under"
        )
    failed, lost = frozenset(failed_ranks), frozenset(lost_holders)
    unknown = sorted(r for r in failed | lost if r not in placement.holders)
    if unknown:
        raise RecoveryPlanError(
            f"ranks {unknown[:10]} are not in the placement of {placement.num_machines} ranks"
        )
    return failed, lost


def _usable_copies(
    inventory: Sequence[ShardCopy], lost: frozenset[int], placement: Placement
) -> _Copies:
    by_version: _Copies = defaultdict(lambda: defaultdict(list))
    for copy in inventory:  # the hot loop of planning: keep it bare
        if copy.complete and copy.holder not in lost:
            by_version[copy.version][copy.rank].append(copy)
    known = placement.holders.keys()
    for copies in by_version.values():
        for stranger in copies.keys() - known:  # a stale report about a rank we do not run
            del copies[stranger]
    return by_version


def _agreeing(rank: int, copies: list[ShardCopy]) -> list[ShardCopy]:
    """Copies of one (rank, version) must hash alike. If they disagree, trust the owner's own
    copy (peers got their bytes from it), else a strict majority; with neither, none."""
    checksums = Counter(c.checksum for c in copies)
    own = [c for c in copies if c.holder == rank]
    if own:
        trusted = own[0].checksum
    else:
        (top, n1), (_, n2) = checksums.most_common(2)
        if n1 == n2:
            return []
        trusted = top
    return [c for c in copies if c.checksum == trusted]


def _newest_complete(usable: _Copies, num_ranks: int) -> tuple[int | None, dict[int, int]]:
    """The newest version that every rank has agreeing copies of, and, when there is none,
    how many ranks the newest version seen misses (for the reason). Copies that disagree with
    the trusted checksum are dropped from `usable` on the way."""
    for version in sorted(usable, reverse=True):
        copies = usable[version]
        if len(copies) < num_ranks:
            continue
        disputed = [r for r, c in copies.items() if len(c) > 1 and len({x.checksum for x in c}) > 1]
        for rank in disputed:
            agreed = _agreeing(rank, copies[rank])
            if agreed:
                copies[rank] = agreed
            else:
                del copies[rank]
        if len(copies) == num_ranks:
            return version, {}
    newest = max(usable, default=None)
    return None, ({newest: num_ranks - len(usable[newest])} if newest is not None else {})


def _memory_sources(
    ranks: Sequence[int],
    copies: Mapping[int, list[ShardCopy]],
    lost: frozenset[int],
    placement: Placement,
) -> dict[int, RankSource]:
    sources: dict[int, RankSource] = {}
    load: Counter[int] = Counter()
    for rank in ranks:
        rank_copies = copies[rank]
        own = rank_copies[0]  # usually the owner's copy comes first; look further if not
        if own.holder != rank:
            own = next((c for c in rank_copies if c.holder == rank), own)
        if own.holder == rank and rank not in lost:
            sources[rank] = RankSource("local", rank, own.checksum)
            continue
        # Spread fetches: the least-loaded holder, preferring placement order on ties.
        order = {h: i for i, h in enumerate(placement.holders[rank])}
        best = min(
            rank_copies, key=lambda c: (load[c.holder], order.get(c.holder, len(order)), c.holder)
        )
        load[best.holder] += 1
        sources[rank] = RankSource("peer", best.holder, best.checksum)
    return sources


def _memory_reason(
    version: int,
    sources: Mapping[int, RankSource],
    failed: frozenset[int],
    replace: tuple[int, ...],
) -> str:
    peers = sum(1 for s in sources.values() if s.kind == "peer")
    parts = [f"restore version {version} from memory"]
    parts.append(f"{len(sources) - peers} ranks from their own memory, {peers} from peers")
    if replace:
        parts.append(f"replace {len(replace)} lost ranks ({_short(replace)})")
    elif failed:
        parts.append(f"restart {len(failed)} failed ranks in place")
    return "; ".join(parts)


def _s3_reason(
    s3_version: int,
    memory_version: int | None,
    missing: Mapping[int, int],
    usable: _Copies,
    ranks: Sequence[int],
) -> str:
    if memory_version is not None:
        return (
            f"restore version {s3_version} from S3: it is newer than version {memory_version}, "
            "the newest complete in memory"
        )
    return f"restore everything from S3 version {s3_version}: " + _memory_gap(
        missing, usable, ranks
    )


def _unrecoverable_reason(missing: Mapping[int, int], usable: _Copies, ranks: Sequence[int]) -> str:
    return (
        "unrecoverable: " + _memory_gap(missing, usable, ranks) + " and S3 has no committed version"
    )


def _memory_gap(missing: Mapping[int, int], usable: _Copies, ranks: Sequence[int]) -> str:
    if not missing:
        return "no complete checkpoint in surviving memory"
    version, count = next(iter(missing.items()))
    absent = [r for r in ranks if r not in usable[version]]
    held = [f"rank {r} at {_versions_of(r, usable) or 'none'}" for r in absent[:3]]
    return (
        f"no version is complete in surviving memory for every rank (version {version} lacks "
        f"{count} ranks: {_short(absent)}; complete copies of {', '.join(held)})"
    )


def _versions_of(rank: int, usable: _Copies) -> str:
    return ", ".join(str(v) for v in sorted(usable, reverse=True) if rank in usable[v])


def _short(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")
