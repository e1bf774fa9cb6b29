"""Speed of the pure algorithms against the issue's targets (medians of several runs).

1. domain-aware placement of 10,000 nodes in 3 zones and 100 racks (m=2), target 50 ms;
2. recovery plan for 10,000 ranks (m=2, two versions per shard, 40,000 inventory entries)
   with 50 lost ranks, target 50 ms;
3. exact recovery probability for N=1024, m=2, k=3 (group layout), target 100 ms.

Each is also measured against a baseline taken in the same run, so a slow machine shows up:
one pass over the same inputs doing the minimum any algorithm must do (touch every machine /
inventory entry). The last line is one JSON object: the worst ratio measured/target.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemini.domain.placement import Machine, domain_aware_placement, mixed_placement
from gemini.domain.probability import _RING_CACHE, recovery_probability
from gemini.domain.recovery import ShardCopy, plan_recovery

RUNS = 15


def median_seconds(work: Callable[[], object], before: Callable[[], None] | None = None) -> float:
    samples = []
    for _ in range(RUNS):
        if before is not None:
            before()
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    n = 10_000
    machines = [
        Machine(r, f"node-{r}", f"zone-{r * 3 // n}", f"rack-{r * 100 // n}") for r in range(n)
    ]
    placement = mixed_placement(n, 2)
    inventory = [
        ShardCopy(rank, version, holder, True, f"{rank}:{version}")
        for rank, holders in placement.holders.items()
        for holder in holders
        for version in (41, 42)
    ]
    lost = list(range(7, n, n // 50))[:50]
    group_1024 = mixed_placement(1024, 2)

    results = {
        "placement_10k_ms": (
            median_seconds(lambda: domain_aware_placement(machines, 2)),
            median_seconds(lambda: sorted(machines, key=lambda m: (m.zone, m.rack))),
            50.0,
        ),
        "plan_10k_50_failed_ms": (
            median_seconds(lambda: plan_recovery(2, placement, lost, lost, inventory, [40])),
            median_seconds(lambda: [c for c in inventory if c.complete]),
            50.0,
        ),
        # Caches cleared before every run: the first question about a layout counts.
        "probability_1024_m2_k3_ms": (
            median_seconds(lambda: recovery_probability(group_1024, 3), _RING_CACHE.clear),
            median_seconds(lambda: [len(h) for h in group_1024.holders.values()]),
            100.0,
        ),
    }
    plan = plan_recovery(2, placement, lost, lost, inventory, [40])
    assert plan.mode == "memory" and len(plan.replace_ranks) == 50, plan.reason
    assert float(recovery_probability(group_1024, 3)) > 0.99

    worst = 0.0
    for name, (seconds, baseline, target_ms) in results.items():
        ms = seconds * 1000
        worst = max(worst, ms / target_ms)
        print(
            f"{name}: {ms:.1f} ms (target {target_ms:.0f} ms, {ms / target_ms:.2f} of it; "
            f"{seconds / baseline:.1f}x one bare pass over the inputs)"
        )
    print(
        json.dumps(
            {
                "metric": "domain_speed_worst_fraction_of_target",
                "value": round(worst, 3),
                "target": 1.0,
                "better": "lower",
                "unit": "ratio",
            }
        )
    )


if __name__ == "__main__":
    main()
