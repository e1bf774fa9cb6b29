"""Placement: the paper's mixed placement, the domain-aware one, and their invariants."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction
from itertools import combinations
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini.domain.placement import (
    Machine,
    Placement,
    PlacementError,
    domain_aware_placement,
    domain_spread,
    mixed_placement,
)
from gemini.domain.probability import recovery_probability


@pytest.mark.parametrize(
    ("n", "m", "groups"),
    [
        pytest.param(5, 2, ((0, 1), (2, 3, 4)), id="five machines in pairs leave a ring of three"),
        pytest.param(16, 2, tuple((i, i + 1) for i in range(0, 16, 2)), id="m divides N: pairs"),
        pytest.param(7, 3, ((0, 1, 2), (3, 4, 5, 6)), id="seven in threes: a ring of four"),
        pytest.param(4, 4, ((0, 1, 2, 3),), id="m equals N: one group"),
        pytest.param(1, 1, ((0,),), id="a single machine with only its local copy"),
        pytest.param(3, 1, ((0,), (1,), (2,)), id="m=1 keeps every shard local"),
    ],
)
def test_mixed_placement_forms_the_papers_groups(n: int, m: int, groups: tuple[Any, ...]) -> None:
    assert mixed_placement(n, m).groups == groups


def test_the_leftover_ring_sends_to_the_next_members() -> None:
    placement = mixed_placement(5, 2)
    assert dict(placement.holders) == {0: (0, 1), 1: (1, 0), 2: (2, 3), 3: (3, 4), 4: (4, 2)}
    assert placement.strategy == "mixed"
    assert placement.receives_from(2) == (4,)


@pytest.mark.parametrize(
    ("n", "m", "strategy"),
    [
        pytest.param(8, 2, "group", id="m dividing N is group placement"),
        pytest.param(9, 2, "mixed", id="a remainder makes it mixed"),
        pytest.param(9, 1, "local-only", id="m=1 has no peers"),
    ],
)
def test_strategy_names_the_layout(n: int, m: int, strategy: str) -> None:
    assert mixed_placement(n, m).strategy == strategy


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: mixed_placement(0, 1), "at least one machine", id="no machines"),
        pytest.param(lambda: mixed_placement(4, 0), "at least 1", id="zero replicas"),
        pytest.param(
            lambda: mixed_placement(3, 4), "at least 4 machines", id="more replicas than machines"
        ),
        pytest.param(
            lambda: domain_aware_placement([Machine(1), Machine(1), Machine(2)], 2),
            "duplicate ranks [1]",
            id="a rank listed twice",
        ),
        pytest.param(
            lambda: domain_aware_placement([Machine(-1), Machine(2)], 2),
            "non-negative",
            id="a negative rank",
        ),
    ],
)
def test_invalid_inputs_say_what_to_fix(make, message: str) -> None:
    with pytest.raises(PlacementError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_unknown_rank_is_an_error() -> None:
    with pytest.raises(PlacementError, match="rank 9"):
        mixed_placement(4, 2).sends_to(9)


def test_a_placement_round_trips_through_its_dict_form() -> None:
    placement = mixed_placement(7, 3)
    again = Placement.from_dict(placement.to_dict())
    assert again == placement
    assert again.receives_from(3) == placement.receives_from(3)


@pytest.mark.parametrize(
    "document",
    [
        pytest.param({}, id="an empty document"),
        pytest.param(
            {
                "replicas": 2,
                "groups": [[0, 1]],
                "holders": {"0": [0, 1], "1": [0, 1]},
                "strategy": "x",
            },
            id="a rank whose holders do not start with itself",
        ),
        pytest.param(
            {
                "replicas": 2,
                "groups": [[0, 1]],
                "holders": {"0": [0, 0], "1": [1, 0]},
                "strategy": "x",
            },
            id="a rank holding its shard twice",
        ),
        pytest.param(
            {"replicas": 1, "groups": [[0]], "holders": {"0": [0], "1": [1]}, "strategy": "x"},
            id="groups that miss a rank",
        ),
        pytest.param(
            {
                "replicas": 2,
                "groups": [[0, 1]],
                "holders": {"0": [0, 5], "1": [1, 0]},
                "strategy": "x",
            },
            id="a holder that is not a rank",
        ),
    ],
)
def test_bad_placement_documents_are_rejected(document: dict[str, Any]) -> None:
    with pytest.raises(PlacementError):
        Placement.from_dict(document)


def _machines(n: int, zones: int, racks: int) -> list[Machine]:
    """Ranks packed into racks in order, racks into zones in order (the naive scheduler)."""
    return [
        Machine(r, f"node-{r}", f"z{(r * racks // n) * zones // racks}", f"r{r * racks // n}")
        for r in range(n)
    ]


@pytest.mark.parametrize(
    ("n", "m", "zones", "racks", "expected"),
    [
        pytest.param(
            30,
            3,
            3,
            9,
            {"zone": 1, "rack": 1, "node": 1},
            id="three equal zones give every triple three zones",
        ),
        pytest.param(
            30,
            3,
            2,
            10,
            {"zone": 2, "rack": 1, "node": 1},
            id="two zones for three replicas share one zone at most twice",
        ),
        pytest.param(
            12,
            2,
            1,
            1,
            {"zone": 2, "rack": 2, "node": 1},
            id="one zone and rack can only spread nodes",
        ),
        pytest.param(
            10000,
            2,
            3,
            100,
            {"zone": 1, "rack": 1, "node": 1},
            id="ten thousand nodes in three zones spread fully",
        ),
    ],
)
def test_domain_aware_spreads_groups(
    n: int, m: int, zones: int, racks: int, expected: dict[str, int]
) -> None:
    machines = _machines(n, zones, racks)
    assert domain_spread(domain_aware_placement(machines, m), machines) == expected


def test_a_zone_larger_than_the_group_count_forces_sharing_only_there() -> None:
    # 30 machines, 10 racks, 3 zones: zone z0 holds 4 racks (12 machines) for 10 groups.
    machines = _machines(30, 3, 10)
    spread = domain_spread(domain_aware_placement(machines, 3), machines)
    assert spread == {"zone": 2, "rack": 1, "node": 1}


def test_the_reason_explains_an_infeasible_spread() -> None:
    reason = domain_aware_placement(_machines(30, 2, 10), 3).reason
    assert "up to 2 members of a group share a zone, the least possible" in reason
    assert "no two members of a group share a rack" in reason


def test_missing_labels_are_named_in_the_reason() -> None:
    reason = domain_aware_placement([Machine(r) for r in range(6)], 2).reason
    assert "no zone labels" in reason and "no rack labels" in reason


def test_mixed_placement_on_packed_racks_shares_racks() -> None:
    machines = _machines(30, 3, 10)
    assert domain_spread(mixed_placement(30, 3), machines)["rack"] == 3


def _check_invariants(placement: Placement, ranks: set[int], m: int) -> None:
    assert set(placement.holders) == ranks
    members = [r for g in placement.groups for r in g]
    assert sorted(members) == sorted(ranks)
    for rank, holders in placement.holders.items():
        assert holders[0] == rank
        assert len(holders) == m == len(set(holders))
        assert len(placement.sends_to(rank)) == m - 1
        assert len(placement.receives_from(rank)) == m - 1
    group_of = {r: i for i, g in enumerate(placement.groups) for r in g}
    for rank, holders in placement.holders.items():
        assert {group_of[h] for h in holders} == {group_of[rank]}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), m=st.integers(1, 4))
def test_mixed_placement_invariants(n: int, m: int) -> None:
    if m > n:
        with pytest.raises(PlacementError):
            mixed_placement(n, m)
        return
    placement = mixed_placement(n, m)
    _check_invariants(placement, set(range(n)), m)
    assert len(placement.groups) == n // m


labels = st.lists(
    st.tuples(st.sampled_from(["", "a", "b", "c"]), st.sampled_from(["", "r1", "r2", "r3", "r4"])),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(layout=labels, m=st.integers(1, 4), offset=st.integers(0, 1000))
def test_domain_aware_invariants_and_optimal_spread(layout: list[Any], m: int, offset: int) -> None:
    if m > len(layout):
        return
    machines = [Machine(offset + 3 * i, "", z, r) for i, (z, r) in enumerate(layout)]
    placement = domain_aware_placement(machines, m)
    _check_invariants(placement, {mc.rank for mc in machines}, m)
    # The largest number of one group's members in a zone is the pigeonhole minimum (with a
    # single zone there is nothing to spread, and the paper's shape is kept instead).
    groups = len(placement.groups)
    zone_of = {mc.rank: mc.zone for mc in machines}
    worst = max(max(Counter(zone_of[r] for r in g).values()) for g in placement.groups)
    largest_zone = max(Counter(zone_of.values()).values())
    if len(set(zone_of.values())) > 1:
        assert worst == math.ceil(largest_zone / groups)


def _probabilities(layout: Placement, n: int) -> list[Fraction]:
    return [recovery_probability(layout, k) for k in range(n + 1)]


@pytest.mark.parametrize("labels", ["none", "one zone and rack"])
def test_without_domains_to_spread_domain_aware_is_never_below_the_papers_placement(labels):
    # Exhaustively for N <= 30, m <= 5, every k: exact probabilities, not samples.
    for n in range(1, 31):
        for m in range(1, min(n, 5) + 1):
            machines = [Machine(r) if labels == "none" else Machine(r, f"n{r}", "z", "r")
                        for r in range(n)]
            aware = _probabilities(domain_aware_placement(machines, m), n)
            paper = _probabilities(mixed_placement(n, m), n)
            assert all(a >= p for a, p in zip(aware, paper, strict=True)), (n, m, aware, paper)


def test_the_issue_case_n11_m3_k3_matches_algorithm_1():
    placement = domain_aware_placement([Machine(r) for r in range(11)], 3)
    assert round(float(recovery_probability(placement, 3)), 4) == 0.9576
    assert "2 groups of 3, 1 group of 5" in placement.reason


def test_three_zones_of_eleven_keep_the_spread_with_fewer_holder_sets():
    # Zones of 4, 4 and 3 machines for 3 groups: one ring of 5 can still hold at most 2 of a
    # zone, as three rings of 4 would, and has fewer holder sets.
    machines = [Machine(r, f"n{r}", f"z{r * 3 // 11}") for r in range(11)]
    placement = domain_aware_placement(machines, 3)
    assert sorted(len(g) for g in placement.groups) == [3, 3, 5]
    by_rank = {m.rank: m.zone for m in machines}
    assert max(max(Counter(by_rank[r] for r in g).values()) for g in placement.groups) == 2


def _partitions(items: list[int], sizes_at_least: int, groups: int) -> Iterator[list[list[int]]]:
    """Every way to split `items` into `groups` unordered groups of at least `sizes_at_least`."""
    if groups == 0:
        if not items:
            yield []
        return
    first, rest = items[0], items[1:]
    for extra in range(sizes_at_least - 1, len(rest) - (groups - 1) * sizes_at_least + 1):
        for chosen in combinations(rest, extra):
            remaining = [x for x in rest if x not in chosen]
            for tail in _partitions(remaining, sizes_at_least, groups - 1):
                yield [[first, *chosen], *tail]


def _spread_of(groups: list[list[int]], machines: list[Machine]) -> tuple[int, ...]:
    by_rank = {m.rank: m for m in machines}
    keys = ([m.zone for m in machines], [(m.zone, m.rack) for m in machines])
    spread = []
    for level, values in zip(("zone", "rack"), keys, strict=True):
        if len(set(values)) < 2:
            spread.append(0)
            continue
        key = (lambda m: m.zone) if level == "zone" else (lambda m: (m.zone, m.rack))
        spread.append(max(max(Counter(key(by_rank[r]) for r in g).values()) for g in groups))
    return tuple(spread)


def _ring_holder_sets(groups: list[list[int]], m: int) -> list[tuple[int, ...]]:
    return [tuple((g + g)[i:i + m]) for g in groups for i in range(len(g))]


@settings(max_examples=25, deadline=None)
@given(layout=st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["r1", "r2", "r3"])),
                       min_size=5, max_size=9), m=st.integers(2, 3))
def test_domain_aware_matches_brute_force_over_every_grouping(layout, m):
    """Against every split into N // m groups: the best spread at every level with more than
    one domain, and among the splits with that spread the highest recovery probability at
    k = m (the fewest holder sets)."""
    machines = [Machine(i, f"n{i}", z, r) for i, (z, r) in enumerate(layout)]
    n = len(machines)
    placement = domain_aware_placement(machines, m)
    chosen = [list(g) for g in placement.groups]
    splits = list(_partitions(list(range(n)), m, n // m))
    best = min(_spread_of(s, machines) for s in splits)
    assert all(best <= _spread_of(s, machines) or not _dominates(_spread_of(s, machines), best)
               for s in splits)
    assert _spread_of(chosen, machines) == best
    feasible = [s for s in splits if _spread_of(s, machines) == best]
    top = max(recovery_probability(_ring_holder_sets(s, m), m) for s in feasible)
    assert recovery_probability(placement, m) == top


def _dominates(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True)) and a != b
