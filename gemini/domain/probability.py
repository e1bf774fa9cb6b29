"""How likely recovery from CPU memory is: exact counts, the paper's closed forms, Monte Carlo.

Recovery from memory fails iff the failed machines include every holder of some shard. For k
machines failing uniformly at random, `recovery_probability` counts the recoverable k-subsets
exactly (a `Fraction`). It never enumerates failure sets of the whole cluster: the holder sets
split into independent components (the placement groups), each component contributes a
polynomial whose j-th coefficient counts its j-subsets that lose no shard, and the cluster's
count for k is the k-th coefficient of their product. Ring-shaped components (all of ours)
are counted by a dynamic program over the ring; other small components by enumeration.

For correlated failures (a whole zone or rack fails together) `monte_carlo_domain_failures`
samples failed domains and reports a Wilson confidence interval.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations

from gemini.domain.placement import Machine, Placement

# Enumeration budget for one irregular component (subsets examined); beyond it, use Monte Carlo.
MAX_ENUMERATED_SUBSETS = 2_000_000

Poly = tuple[int, ...]


class ProbabilityError(ValueError):
    """The question has no answer as asked (k out of range, layout too irregular to count)."""


def recovery_probability(
    layout: Placement | Iterable[Iterable[int]],
    failures: int,
    num_machines: int | None = None,
) -> Fraction:
    """Exact probability that `failures` machines failing uniformly at random leave at least
    one complete copy of every shard in memory.

    `layout` is a Placement or the holder sets themselves (one collection of machine ids per
    shard). `num_machines` defaults to the number of machines in the layout; more machines
    (holding nothing) may be given.
    """
    components, machines = _components(layout, failures)
    total = machines if num_machines is None else num_machines
    if total < machines:
        raise ProbabilityError(f"num_machines={total} is less than the {machines} in the layout")
    if not 0 <= failures <= total:
        raise ProbabilityError(f"failures must be between 0 and N={total}, got {failures}")
    product: Poly = (1,)
    for poly, count in Counter(components).items():
        product = _multiply(product, _power(poly, count, failures), failures)
    free = tuple(math.comb(total - machines, j) for j in range(failures + 1))
    survivors = _multiply(product, free, failures)[failures]
    return Fraction(survivors, math.comb(total, failures))


def group_closed_form(num_machines: int, replicas: int, failures: int) -> Fraction:
    """The paper's formula for group placement: 1 if k < m, else
    max(0, 1 - (N/m) C(N-m, k-m) / C(N, k)). A lower bound, exact when k < 2m."""
    return _closed_form(num_machines, replicas, failures, Fraction(num_machines, replicas))


def ring_closed_form(num_machines: int, replicas: int, failures: int) -> Fraction:
    """The paper's formula for ring placement (N holder sets instead of N/m). A lower bound;
    for rings it is not exact even for k < 2m, because neighbouring holder sets overlap (N=16,
    m=2, k=3: the paper's 60.0% is this bound, the exact value is 62.9%)."""
    return _closed_form(num_machines, replicas, failures, Fraction(num_machines))


@dataclass(frozen=True)
class MonteCarloEstimate:
    """Recovered fraction of the sampled failure scenarios with a Wilson score interval."""

    probability: float
    low: float
    high: float
    trials: int
    recovered: int
    confidence: float = 0.95

    def to_dict(self) -> dict[str, float | int]:
        return {
            "probability": self.probability,
            "low": self.low,
            "high": self.high,
            "trials": self.trials,
            "recovered": self.recovered,
            "confidence": self.confidence,
        }


def monte_carlo_domain_failures(
    placement: Placement,
    machines: Sequence[Machine],
    *,
    level: str = "zone",
    domains: int = 1,
    extra_failures: int = 0,
    trials: int = 2000,
    seed: int = 0,
) -> MonteCarloEstimate:
    """Estimate the probability of recovering from memory when `domains` whole failure domains
    of `level` ("zone", "rack" or "node") fail together, plus `extra_failures` further machines
    at random. Deterministic for a given seed (the caller picks it; no clock is read)."""
    domain_of = _domain_of(placement, machines, level)
    names = sorted(set(domain_of.values()))
    if not 1 <= domains <= len(names):
        raise ProbabilityError(f"cannot fail {domains} of the {len(names)} {level}s")
    if trials < 1:
        raise ProbabilityError(f"trials must be positive, got {trials}")
    largest = sorted(Counter(domain_of.values()).values(), reverse=True)[:domains]
    fewest_left = len(domain_of) - sum(largest)  # after the largest domains fail
    if not 0 <= extra_failures <= fewest_left:
        raise ProbabilityError(
            f"extra_failures must be between 0 and {fewest_left}, got {extra_failures}"
        )
    sampler = _DomainSampler(placement, domain_of)
    rng = random.Random(seed)
    recovered = sum(
        sampler.recovers(set(rng.sample(names, domains)), extra_failures, rng)
        for _ in range(trials)
    )
    low, high = wilson_interval(recovered, trials)
    return MonteCarloEstimate(recovered / trials, low, high, trials, recovered)


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval (95% by default); sensible even at 0% or 100% observed."""
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    # At 0% or 100% observed the interval reaches the bound exactly (no rounding error).
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


class _DomainSampler:
    """Decides per scenario whether some shard lost all its holders, touching only the shards
    that the failures can affect (the whole cluster is never scanned per trial)."""

    def __init__(self, placement: Placement, domain_of: Mapping[int, str]) -> None:
        self._holders = placement.holders
        self._domain_of = domain_of
        self._machines = sorted(domain_of)
        self._held_by: dict[int, list[int]] = defaultdict(list)
        for rank, holders in placement.holders.items():
            for holder in holders:
                self._held_by[holder].append(rank)
        # A shard is lost to domain failures alone iff all its holders' domains failed; index
        # the distinct domain sets by each of their domains.
        self._sets_with: dict[str, list[frozenset[str]]] = defaultdict(list)
        for domains in {frozenset(domain_of[h] for h in hs) for hs in placement.holders.values()}:
            for domain in domains:
                self._sets_with[domain].append(domains)
        self._size = Counter(domain_of.values())

    def recovers(self, failed_domains: set[str], extra: int, rng: random.Random) -> bool:
        for domain in failed_domains:
            if any(domains <= failed_domains for domains in self._sets_with[domain]):
                return False
        if not extra:
            return True
        extra_failed = self._sample_alive(failed_domains, extra, rng)
        for machine in extra_failed:
            for rank in self._held_by[machine]:
                if all(
                    h in extra_failed or self._domain_of[h] in failed_domains
                    for h in self._holders[rank]
                ):
                    return False
        return True

    def _sample_alive(self, failed_domains: set[str], count: int, rng: random.Random) -> set[int]:
        machines, domain_of = self._machines, self._domain_of
        if 2 * (sum(self._size[d] for d in failed_domains) + count) > len(machines):
            return set(
                rng.sample([m for m in machines if domain_of[m] not in failed_domains], count)
            )
        chosen: set[int] = set()  # mostly alive: rejection sampling avoids an O(N) list
        while len(chosen) < count:
            machine = machines[rng.randrange(len(machines))]
            if domain_of[machine] not in failed_domains:
                chosen.add(machine)
        return chosen


def _domain_of(placement: Placement, machines: Sequence[Machine], level: str) -> dict[int, str]:
    by_rank = {m.rank: m for m in machines}
    missing = [r for r in placement.holders if r not in by_rank]
    if missing:
        raise ProbabilityError(f"no machine labels for ranks {missing[:5]}")
    if level == "zone":
        return {r: by_rank[r].zone for r in placement.holders}
    if level == "rack":
        return {r: f"{by_rank[r].zone}/{by_rank[r].rack}" for r in placement.holders}
    if level == "node":
        return {r: by_rank[r].node_key() for r in placement.holders}
    raise ProbabilityError(f"level must be zone, rack or node, got {level!r}")


def _closed_form(n: int, m: int, k: int, holder_sets: Fraction) -> Fraction:
    if not 1 <= m <= n or not 0 <= k <= n:
        raise ProbabilityError(f"need 1 <= m <= N and 0 <= k <= N, got N={n}, m={m}, k={k}")
    if k < m:
        return Fraction(1)
    return max(Fraction(0), 1 - holder_sets * math.comb(n - m, k - m) / math.comb(n, k))


def _components(layout: Placement | Iterable[Iterable[int]], degree: int) -> tuple[list[Poly], int]:
    """Survival polynomials of the independent components (ring ones truncated at `degree`),
    and the number of machines they cover."""
    if isinstance(layout, Placement) and _is_ring_grouped(layout):
        polys = [_ring_poly(len(g), layout.replicas, degree) for g in layout.groups]
        return polys, layout.num_machines
    holder_sets = (
        layout.holder_sets()
        if isinstance(layout, Placement)
        else list(dict.fromkeys(frozenset(h) for h in layout))
    )
    if any(not h for h in holder_sets):
        raise ProbabilityError("every shard needs at least one holder")
    return _generic_components(holder_sets)


def _is_ring_grouped(placement: Placement) -> bool:
    m = placement.replicas
    seen = 0
    for group in placement.groups:
        if len(group) < m:
            return False
        doubled = group + group
        for i, rank in enumerate(group):
            if placement.holders.get(rank) != doubled[i : i + m]:
                return False
        seen += len(group)
    return seen == placement.num_machines


def _generic_components(holder_sets: Sequence[frozenset[int]]) -> tuple[list[Poly], int]:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = parent.setdefault(x, x)
        while root != parent[root]:
            root = parent[root]
        while x != root:
            parent[x], x = root, parent[x]
        return root

    for holders in holder_sets:
        first, *rest = holders
        for other in rest:
            parent[find(other)] = find(first)
        find(first)
    members: dict[int, list[int]] = defaultdict(list)
    for machine in parent:
        members[find(machine)].append(machine)
    sets_of: dict[int, list[frozenset[int]]] = defaultdict(list)
    for holders in holder_sets:
        sets_of[find(next(iter(holders)))].append(holders)
    polys = [_enumerated_poly(sorted(members[root]), sets) for root, sets in sets_of.items()]
    return polys, len(parent)


def _enumerated_poly(machines: Sequence[int], holder_sets: Sequence[frozenset[int]]) -> Poly:
    """Count, for each j, the j-subsets of this component that contain no holder set."""
    size = len(machines)
    if 2**size > MAX_ENUMERATED_SUBSETS:
        raise ProbabilityError(
            f"a component of {size} machines with an irregular layout is too large to count "
            "exactly; use monte_carlo_domain_failures or a ring/group placement"
        )
    index = {machine: i for i, machine in enumerate(machines)}
    masks = [sum(1 << index[h] for h in holders) for holders in holder_sets]
    counts = [0] * (size + 1)
    for j in range(size + 1):
        for chosen in combinations(range(size), j):
            mask = sum(1 << i for i in chosen)
            if not any(mask & h == h for h in masks):
                counts[j] += 1
    return tuple(counts)


def _ring_poly(size: int, window: int, degree: int) -> Poly:
    """j-subsets (j <= degree) of a ring of `size` machines with no `window` cyclically
    consecutive ones (each shard's holders are `window` consecutive members). A group is the
    case size == window."""
    key = (size, window, degree)
    if key not in _RING_CACHE:
        _RING_CACHE[key] = _count_ring(size, window, degree)
    return _RING_CACHE[key]


_RING_CACHE: dict[tuple[int, int, int], Poly] = {}


def _count_ring(size: int, window: int, degree: int) -> Poly:
    # Sets that spare at least one machine: rotate to the first spared one, at position a
    # (a failed machines before it, a < window); the other size-1-a positions form a line with
    # no run of `window` failures whose trailing run b keeps a + b < window across the seam.
    # The set of all machines is never survivable (size >= window).
    lines = _line_counts(size - 1, window, degree)
    counts = [0] * (min(size, degree) + 1)
    for lead in range(min(window, size)):
        for (ones, trail), ways in lines[size - 1 - lead].items():
            if lead + trail < window and ones + lead <= degree:
                counts[ones + lead] += ways
    return tuple(counts)


def _line_counts(length: int, window: int, degree: int) -> dict[int, dict[tuple[int, int], int]]:
    """For n in (length-window, length]: {(failed, trailing failed run): count} over lines of
    n machines with no run of `window` failures and at most `degree` failed."""
    row: dict[tuple[int, int], int] = {(0, 0): 1}
    kept = {0: row}
    for n in range(1, length + 1):
        nxt: dict[tuple[int, int], int] = defaultdict(int)
        for (ones, trail), ways in row.items():
            nxt[(ones, 0)] += ways
            if trail + 1 < window and ones < degree:
                nxt[(ones + 1, trail + 1)] += ways
        row = dict(nxt)
        if n > length - window:
            kept[n] = row
    return kept


def _multiply(a: Poly, b: Poly, degree: int) -> Poly:
    out = [0] * (min(len(a) + len(b) - 1, degree + 1))
    for i, x in enumerate(a[: degree + 1]):
        if x:
            for j, y in enumerate(b[: degree + 1 - i]):
                out[i + j] += x * y
    return tuple(out)


def _power(poly: Poly, exponent: int, degree: int) -> Poly:
    result: Poly = (1,)
    base = poly[: degree + 1]
    while exponent:
        if exponent & 1:
            result = _multiply(result, base, degree)
        exponent >>= 1
        if exponent:
            base = _multiply(base, base, degree)
    return result
