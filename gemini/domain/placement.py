"""Replica placement: which machines hold each rank's in-memory checkpoint.

Every rank's shard lives in its own machine's memory plus the memory of m-1 peers. The
paper's mixed placement (Algorithm 1) puts consecutive machines into groups of m and, when m
does not divide N, lets the last group absorb the leftover machines and use ring placement
inside. The failure-domain-aware placement is ours (beyond the paper): it forms the groups so
that their members sit in different zones, racks and nodes whenever the labels allow it.

In both, a group of s members uses ring placement inside: member i's shard is held by members
i, i+1, ..., i+m-1 (mod s). For s = m that is the paper's group placement (everyone holds
everyone's shard); for s > m it is a ring. Either way every machine sends and receives exactly
m-1 copies. Ranks are the holder ids: rank r's sidecar holds rank r's shard and its peers'.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

STRATEGY_LOCAL = "local-only"
STRATEGY_GROUP = "group"
STRATEGY_MIXED = "mixed"
STRATEGY_DOMAIN_AWARE = "domain-aware"


class PlacementError(ValueError):
    """The inputs admit no placement (m > N, m < 1, N < 1, duplicate ranks, bad layout)."""


@dataclass(frozen=True, slots=True)
class Machine:
    """One training machine (one worker pod) and its failure-domain labels.

    Empty labels mean unknown; unknown zones or racks are treated as one shared domain, which
    is the conservative reading (they may well be the same). An empty node means the rank has
    a node of its own.
    """

    rank: int
    node: str = ""
    zone: str = ""
    rack: str = ""

    def node_key(self) -> str:
        return self.node or f"rank-{self.rank}"

    def rack_key(self) -> tuple[str, str]:
        # Rack names are only unique within a zone in many clusters.
        return (self.zone, self.rack)


@dataclass(frozen=True)
class Placement:
    """Who holds which shard.

    `groups` are the placement groups (ring placement inside each); `holders[r]` are the ranks
    whose memory holds rank r's shard, r itself first, then the peers it sends to.
    """

    replicas: int
    groups: tuple[tuple[int, ...], ...]
    holders: Mapping[int, tuple[int, ...]]
    strategy: str
    reason: str
    # rank -> the ranks whose shards it holds a replica of; built on first use.
    _receivers: dict[int, tuple[int, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _check_holders(self.replicas, self.holders, self.groups)
        object.__setattr__(self, "holders", MappingProxyType(dict(self.holders)))

    @property
    def num_machines(self) -> int:
        return len(self.holders)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.holders)

    def sends_to(self, rank: int) -> tuple[int, ...]:
        """The peers that receive a copy of `rank`'s shard (m-1 of them)."""
        return self.holders[self._known(rank)][1:]

    def receives_from(self, rank: int) -> tuple[int, ...]:
        """The ranks whose shards `rank` holds a copy of, besides its own (m-1 of them)."""
        if not self._receivers:
            self._receivers.update(_reverse(self.holders))
        return self._receivers[self._known(rank)]

    def holder_sets(self) -> tuple[frozenset[int], ...]:
        """The distinct sets of machines that hold some shard (what recovery depends on)."""
        return tuple(dict.fromkeys(frozenset(h) for h in self.holders.values()))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (keys of `holders` become strings); `from_dict` reads it back."""
        return {
            "replicas": self.replicas,
            "strategy": self.strategy,
            "reason": self.reason,
            "groups": [list(g) for g in self.groups],
            "holders": {str(r): list(h) for r, h in self.holders.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        try:
            return cls(
                replicas=int(data["replicas"]),
                groups=tuple(tuple(int(r) for r in g) for g in data["groups"]),
                holders={int(r): tuple(int(x) for x in h) for r, h in data["holders"].items()},
                strategy=str(data["strategy"]),
                reason=str(data.get("reason", "")),
            )
        except PlacementError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise PlacementError(f"not a placement document ({err!r})") from err

    def _known(self, rank: int) -> int:
        if rank not in self.holders:
            raise PlacementError(f"rank {rank} is not part of this placement")
        return rank


def mixed_placement(num_machines: int, replicas: int) -> Placement:
    """GEMINI's Algorithm 1 over ranks 0..N-1: groups of m consecutive ranks; when m does not
    divide N the last group absorbs the N mod m leftover ranks and uses ring placement."""
    _check_sizes(num_machines, replicas)
    count = num_machines // replicas
    groups = [tuple(range(g * replicas, (g + 1) * replicas)) for g in range(count)]
    leftover = num_machines - count * replicas
    if leftover:
        groups[-1] = tuple(range((count - 1) * replicas, num_machines))
    strategy, reason = _describe_mixed(num_machines, replicas, count, leftover)
    return _from_groups(replicas, groups, strategy, reason)


def domain_aware_placement(machines: Sequence[Machine], replicas: int) -> Placement:
    """Groups whose members sit in different zones, racks and nodes when the labels allow it,
    and otherwise the paper's shape (never a lower recovery probability than Algorithm 1).

    Beyond the paper. Sort machines by (zone, rack, node) so that every domain is a contiguous
    block, then deal them round-robin into g = N // m groups (position i joins group i mod g).
    A domain block of z machines then puts at most ceil(z / g) members into any one group,
    which is the least possible by pigeonhole, for zones, racks and nodes at the same time.
    That deal spreads the r = N mod m leftover machines over the groups (rings of m+1 or
    more), which has more holder sets than Algorithm 1's one ring of m+r: with r rings of m+1,
    (r-1)(m-1) more shards whose holders can all fail together, so a lower recovery
    probability. So the rings are merged into one, member by member, as far as the spread
    stays that of the deal at every level with more than one domain: Algorithm 1's shape
    whenever labels are absent or all alike, and the fewest holder sets otherwise.
    """
    _check_sizes(len(machines), replicas)
    _check_unique_ranks(machines)
    ordered = sorted(machines, key=_sort_key)
    count = len(ordered) // replicas
    spread_groups = [ordered[start::count] for start in range(count)]
    groups = _fewest_holder_sets(ordered, spread_groups, replicas)
    reason = _describe_spread(ordered, groups, replicas)
    ranks = tuple(tuple(m.rank for m in group) for group in groups)
    return _from_groups(replicas, ranks, STRATEGY_DOMAIN_AWARE, reason)


def _fewest_holder_sets(
    ordered: Sequence[Machine], spread_groups: list[list[Machine]], replicas: int,
) -> list[list[Machine]]:
    """Merge the rings (groups of more than m) into one larger ring, a member at a time, while
    the spread stays that of `spread_groups` at every level: each ring shrunk to a group of m
    removes m-1 holder sets."""
    rings = [i for i, g in enumerate(spread_groups) if len(g) > replicas]
    if len(rings) < 2:  # m <= 2 or one leftover: already the paper's shape
        return spread_groups
    levels = [lv for lv in _LEVELS if len({_domain_key(m, lv) for m in ordered}) > 1]
    best = _group_spread(spread_groups, levels)
    chosen = spread_groups
    for target in rings:
        groups = [list(g) for g in spread_groups]
        for donor in (i for i in rings if i != target):
            while len(groups[donor]) > replicas:
                move = _least_crowding(groups[target], groups[donor], levels, best)
                if move is None:
                    break
                groups[donor].remove(move)
                groups[target].append(move)
        if _holder_sets(groups, replicas) < _holder_sets(chosen, replicas):
            chosen = groups
    return chosen


def _holder_sets(groups: Sequence[Sequence[Machine]], replicas: int) -> int:
    return sum(len(g) if len(g) > replicas else 1 for g in groups)


def _least_crowding(
    target: list[Machine], donor: list[Machine], levels: Sequence[str], best: list[int],
) -> Machine | None:
    """The donor member whose move into `target` crowds it least, if it keeps the spread."""
    options = []
    for machine in donor:
        spread = _group_spread([[*target, machine]], levels)
        if all(a <= b for a, b in zip(spread, best, strict=True)):
            options.append((spread, machine.rank, machine))
    return min(options)[2] if options else None


def _group_spread(groups: Sequence[Sequence[Machine]], levels: Sequence[str]) -> list[int]:
    """Per level with more than one domain, the most members of one group in one domain
    (a level with a single domain has nothing to spread, whatever the shape)."""
    return [max(max(Counter(_domain_key(m, level) for m in g).values()) for g in groups)
            for level in levels]


def domain_spread(placement: Placement, machines: Sequence[Machine]) -> dict[str, int]:
    """For each level (zone, rack, node): the largest number of one shard's holders in a
    single domain of that level (1 means every shard survives the loss of any one domain)."""
    by_rank = {m.rank: m for m in machines}
    missing = [r for r in placement.holders if r not in by_rank]
    if missing:
        raise PlacementError(f"no machine labels for ranks {missing[:5]}")
    spread = {"zone": 1, "rack": 1, "node": 1}
    for holder_set in placement.holder_sets():
        group = [by_rank[r] for r in holder_set]
        for level, worst in _worst_per_level(group).items():
            spread[level] = max(spread[level], worst)
    return spread


def _from_groups(
    replicas: int, groups: Sequence[tuple[int, ...]], strategy: str, reason: str
) -> Placement:
    holders: dict[int, tuple[int, ...]] = {}
    for group in groups:
        size = len(group)
        doubled = group + group
        for i, rank in enumerate(group):
            holders[rank] = doubled[i : i + replicas] if replicas < size else doubled[i : i + size]
    return Placement(replicas, tuple(groups), holders, strategy, reason)


def _check_sizes(num_machines: int, replicas: int) -> None:
    if num_machines < 1:
        raise PlacementError(f"need at least one machine, got N={num_machines}")
    if replicas < 1:
        raise PlacementError(f"replicas must be at least 1 (the local copy), got m={replicas}")
    if replicas > num_machines:
        raise PlacementError(
            f"m={replicas} replicas need at least {replicas} machines, got N={num_machines}; "
            "lower the replicas or add machines"
        )


def _check_unique_ranks(machines: Sequence[Machine]) -> None:
    counts = Counter(m.rank for m in machines)
    duplicates = sorted(r for r, c in counts.items() if c > 1)
    if duplicates:
        raise PlacementError(f"duplicate ranks {duplicates[:10]}: each rank must appear once")
    negative = sorted(r for r in counts if r < 0)
    if negative:
        raise PlacementError(f"ranks must be non-negative, got {negative[:10]}")


def _check_holders(
    replicas: int, holders: Mapping[int, tuple[int, ...]], groups: Sequence[tuple[int, ...]]
) -> None:
    if replicas < 1 or replicas > max(len(holders), 1):
        raise PlacementError(f"m={replicas} does not fit N={len(holders)} machines")
    for rank, rank_holders in holders.items():
        if (
            len(rank_holders) != replicas
            or rank_holders[0] != rank
            or (replicas > 1 and len(set(rank_holders)) != replicas)
        ):
            raise PlacementError(
                f"rank {rank} must have exactly {replicas} distinct holders, itself first; "
                f"got {rank_holders}"
            )
    unknown = {h for rank_holders in holders.values() for h in rank_holders}.difference(holders)
    if unknown:
        raise PlacementError(f"holders {sorted(unknown)[:10]} are not ranks of the placement")
    members = [r for group in groups for r in group]
    if len(members) != len(holders) or set(members) != holders.keys():
        raise PlacementError("the groups must list every rank of the placement exactly once")


def _reverse(holders: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    received: dict[int, list[int]] = {rank: [] for rank in holders}
    for rank, rank_holders in holders.items():
        for peer in rank_holders[1:]:
            received[peer].append(rank)
    return {rank: tuple(sources) for rank, sources in received.items()}


def _describe_mixed(n: int, m: int, count: int, leftover: int) -> tuple[str, str]:
    if m == 1:
        return STRATEGY_LOCAL, f"m=1: each of the {n} machines keeps only its own shard"
    if not leftover:
        return STRATEGY_GROUP, f"group placement: {count} groups of {m} (m divides N={n})"
    return STRATEGY_MIXED, (
        f"mixed placement: {count - 1} groups of {m} and one ring of {m + leftover} "
        f"(N={n} is not a multiple of m={m})"
    )


_LEVELS = ("zone", "rack", "node")


def _sort_key(machine: Machine) -> tuple[str, str, str, int]:
    # Unlabelled nodes sort by rank, each its own node.
    return (machine.zone, machine.rack, machine.node, machine.rank)


def _domain_key(machine: Machine, level: str) -> object:
    """Nested keys, so a domain is one contiguous block in `_sort_key` order."""
    if level == "zone":
        return machine.zone
    if level == "rack":
        return machine.rack_key()
    return (machine.zone, machine.rack, machine.node_key())


def _worst_per_level(group: Iterable[Machine]) -> dict[str, int]:
    members = list(group)
    return {
        level: max(Counter(_domain_key(m, level) for m in members).values()) for level in _LEVELS
    }


def _describe_spread(
    ordered: Sequence[Machine], groups: Sequence[Sequence[Machine]], replicas: int,
) -> str:
    """Explain the spread. The groups spread as well as dealing contiguous domain blocks
    round-robin into `count` groups, which gives ceil(z / count) members of the largest domain
    (z machines) per group: the least possible, by pigeonhole."""
    if replicas == 1:
        return "m=1: each machine keeps only its own shard; no groups to spread"
    count = len(groups)
    sizes = Counter(len(g) for g in groups)
    shape = ", ".join(f"{n} group{'s' if n > 1 else ''} of {size}"
                      for size, n in sorted(sizes.items()))
    parts = []
    counts: dict[str, Counter[object]] = {
        "zone": Counter(m.zone for m in ordered),
        "rack": Counter((m.zone, m.rack) for m in ordered),
        "node": Counter((m.zone, m.rack, m.node or m.rank) for m in ordered),
    }
    for level in _LEVELS:
        domains = counts[level]
        largest = max(domains.values())
        worst = max(max(Counter(_domain_key(m, level) for m in g).values()) for g in groups)
        if level != "node" and not any(getattr(m, level) for m in ordered):
            parts.append(f"no {level} labels, so {level}s could not be spread")
        elif len(domains) == 1:
            parts.append(f"every machine is in one {level}, so {level}s could not be spread")
        elif worst == 1:
            parts.append(f"no two members of a group share a {level}")
        else:
            parts.append(
                f"up to {worst} members of a group share a {level}, the least possible "
                f"({len(domains)} {level}s, the largest with {largest} machines for {count} groups)"
            )
    return f"domain-aware placement, {shape}: " + "; ".join(parts)
