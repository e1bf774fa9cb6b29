"""Recovery probability: the paper's reference values, exact counting, and Monte Carlo."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations, pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini.domain.placement import Machine, Placement, domain_aware_placement, mixed_placement
from gemini.domain.probability import (
    ProbabilityError,
    group_closed_form,
    monte_carlo_domain_failures,
    recovery_probability,
    ring_closed_form,
    wilson_interval,
)


def ring(n: int, m: int) -> list[tuple[int, ...]]:
    return [tuple((i + j) % n for j in range(m)) for i in range(n)]


def brute_force(holder_sets: list[Any], machines: int, k: int) -> Fraction:
    sets = [frozenset(h) for h in holder_sets]
    total = ok = 0
    for failed in combinations(range(machines), k):
        down = set(failed)
        total += 1
        ok += not any(h <= down for h in sets)
    return Fraction(ok, total)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(
            lambda: recovery_probability(mixed_placement(16, 2), 2),
            "0.933",
            id="paper: N=16 m=2 two failures 93.3%",
        ),
        pytest.param(
            lambda: recovery_probability(mixed_placement(16, 2), 3),
            "0.800",
            id="paper: N=16 m=2 three failures 80.0%",
        ),
        pytest.param(
            lambda: ring_closed_form(16, 2, 3),
            "0.600",
            id="paper: the ring's 60.0% is its closed form",
        ),
        pytest.param(
            lambda: recovery_probability(mixed_placement(64, 2), 2),
            "0.984",
            id="paper: N=64 m=2 two failures 98.4%",
        ),
        pytest.param(
            lambda: recovery_probability(ring(16, 2), 3),
            "0.629",
            id="the ring's exact value is 62.9%",
        ),
    ],
)
def test_reference_values(value, expected: str) -> None:
    assert f"{float(value()):.3f}" == expected


def test_exact_values_are_fractions() -> None:
    assert recovery_probability(mixed_placement(16, 2), 3) == Fraction(4, 5)
    assert recovery_probability(ring(16, 2), 3) == Fraction(22, 35)


@pytest.mark.parametrize(
    ("n", "m", "k", "expected"),
    [
        pytest.param(8, 2, 1, Fraction(1), id="fewer failures than replicas always recover"),
        pytest.param(8, 1, 1, Fraction(0), id="with m=1 any machine failure loses a shard"),
        pytest.param(4, 4, 4, Fraction(0), id="losing every machine loses everything"),
        pytest.param(8, 2, 0, Fraction(1), id="no failures recover trivially"),
    ],
)
def test_edge_cases(n: int, m: int, k: int, expected: Fraction) -> None:
    assert recovery_probability(mixed_placement(n, m), k) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            (mixed_placement(4, 2), 5), "between 0 and N=4", id="more failures than machines"
        ),
        pytest.param((mixed_placement(4, 2), -1), "between 0", id="negative failures"),
        pytest.param(([[0, 1], []], 1), "at least one holder", id="a shard without holders"),
    ],
)
def test_questions_without_answers_raise(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ProbabilityError, match=message):
        recovery_probability(*args)


def test_irregular_layouts_too_large_to_count_are_refused() -> None:
    chain = [(i, i + 1) for i in range(40)]
    with pytest.raises(ProbabilityError, match="monte_carlo"):
        recovery_probability(chain, 3)


def test_extra_machines_holding_nothing_are_counted() -> None:
    # Two machines holding one shard among ten: lost only if both fail.
    assert recovery_probability([[0, 1]], 2, num_machines=10) == 1 - Fraction(1, 45)


@settings(max_examples=40, deadline=None)
@given(
    machines=st.integers(2, 9),
    data=st.data(),
)
def test_exact_counting_matches_brute_force_for_any_layout(machines: int, data) -> None:
    sets = data.draw(
        st.lists(
            st.sets(st.integers(0, machines - 1), min_size=1, max_size=3), min_size=1, max_size=8
        )
    )
    k = data.draw(st.integers(0, machines))
    assert recovery_probability(sets, k, num_machines=machines) == brute_force(sets, machines, k)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), m=st.integers(1, 4), k=st.integers(0, 12))
def test_placements_count_like_their_holder_sets(n: int, m: int, k: int) -> None:
    if m > n or k > n:
        return
    for placement in (
        mixed_placement(n, m),
        domain_aware_placement([Machine(r, zone=f"z{r % 3}") for r in range(n)], m),
    ):
        holder_sets = [list(h) for h in placement.holders.values()]
        assert recovery_probability(placement, k) == brute_force(holder_sets, n, k)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 200), m=st.integers(1, 4))
def test_probability_is_monotone_in_failures(n: int, m: int) -> None:
    if m > n:
        return
    placement = mixed_placement(n, m)
    values = [recovery_probability(placement, k) for k in range(min(n, 8) + 1)]
    assert all(a >= b for a, b in pairwise(values))


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 60), m=st.integers(1, 4), k=st.integers(0, 12))
def test_group_closed_form_is_a_bound_exact_below_2m(groups: int, m: int, k: int) -> None:
    n = groups * m
    if k > n:
        return
    exact = recovery_probability(mixed_placement(n, m), k)
    bound = group_closed_form(n, m, k)
    assert bound <= exact
    if k < 2 * m:
        assert bound == exact


def test_ring_closed_form_is_a_lower_bound_and_rings_count_alike_either_way() -> None:
    holders = {i: tuple((i + j) % 16 for j in range(2)) for i in range(16)}
    ring_placement = Placement(2, (tuple(range(16)),), holders, "ring", "one ring of 16")
    for k in (2, 3, 5, 8):
        exact = recovery_probability(ring_placement, k)
        assert ring_closed_form(16, 2, k) <= exact
        assert exact == recovery_probability(ring(16, 2), k)


def packed(n: int, zones: int, racks: int) -> list[Machine]:
    return [
        Machine(r, f"n{r}", f"z{(r * racks // n) * zones // racks}", f"r{r * racks // n}")
        for r in range(n)
    ]


@pytest.mark.parametrize(
    ("make", "level", "expected"),
    [
        pytest.param(
            lambda ms: domain_aware_placement(ms, 2),
            "zone",
            1.0,
            id="domain-aware pairs survive any zone",
        ),
        pytest.param(
            lambda ms: mixed_placement(len(ms), 2),
            "zone",
            0.0,
            id="packed mixed pairs die with a zone",
        ),
        pytest.param(
            lambda ms: domain_aware_placement(ms, 2),
            "rack",
            1.0,
            id="domain-aware pairs survive any rack",
        ),
        pytest.param(
            lambda ms: mixed_placement(len(ms), 2),
            "rack",
            0.0,
            id="packed mixed pairs die with a rack",
        ),
    ],
)
def test_whole_domain_failures(make, level: str, expected: float) -> None:
    machines = packed(60, 3, 6)
    estimate = monte_carlo_domain_failures(make(machines), machines, level=level, trials=200)
    assert estimate.probability == expected
    assert estimate.low <= expected <= estimate.high


def test_monte_carlo_interval_covers_the_exact_value_for_random_failures() -> None:
    placement = mixed_placement(16, 2)
    machines = [Machine(r) for r in range(16)]
    estimate = monte_carlo_domain_failures(
        placement, machines, level="node", domains=1, extra_failures=2, trials=4000, seed=7
    )
    exact = float(recovery_probability(placement, 3))
    assert estimate.low <= exact <= estimate.high
    assert estimate.high - estimate.low < 0.04


def test_monte_carlo_is_deterministic_per_seed() -> None:
    placement, machines = mixed_placement(30, 3), packed(30, 3, 9)
    run = lambda seed: monte_carlo_domain_failures(  # noqa: E731
        placement, machines, level="rack", extra_failures=3, trials=300, seed=seed
    )
    assert run(1) == run(1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"level": "region"}, "zone, rack or node", id="an unknown level"),
        pytest.param({"domains": 4}, "cannot fail 4 of the 3 zones", id="more domains than exist"),
        pytest.param({"trials": 0}, "trials", id="no trials"),
        pytest.param(
            {"extra_failures": 9}, "between 0 and 8", id="more extra failures than survive"
        ),
    ],
)
def test_monte_carlo_rejects_bad_questions(kwargs: dict[str, Any], message: str) -> None:
    machines = packed(12, 3, 3)
    with pytest.raises(ProbabilityError, match=message):
        monte_carlo_domain_failures(mixed_placement(12, 2), machines, **kwargs)


@pytest.mark.parametrize(
    ("successes", "trials"),
    [
        pytest.param(0, 100, id="none observed"),
        pytest.param(100, 100, id="all observed"),
        pytest.param(37, 80, id="some observed"),
    ],
)
def test_wilson_interval_brackets_the_observation(successes: int, trials: int) -> None:
    low, high = wilson_interval(successes, trials)
    assert 0 <= low <= successes / trials <= high <= 1
    assert high - low > 0
