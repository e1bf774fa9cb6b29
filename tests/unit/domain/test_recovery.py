"""Recovery planning: version choice, sources, replacements, S3 fallback, failure kinds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini.domain.placement import Placement, mixed_placement
from gemini.domain.recovery import (
    FailureKind,
    RecoveryPlanError,
    ShardCopy,
    classify_failure,
    plan_recovery,
    worst_failure,
)


@pytest.mark.parametrize(
    ("observed", "kind"),
    [
        pytest.param({}, None, id="a healthy rank is no failure"),
        pytest.param(
            {"process_exited": True}, FailureKind.SOFTWARE, id="a crash on a live pod is software"
        ),
        pytest.param({"pod_lost": True}, FailureKind.HARDWARE, id="a deleted pod is hardware"),
        pytest.param(
            {"node_lost": True, "process_exited": True},
            FailureKind.HARDWARE,
            id="a lost node outranks the crash it caused",
        ),
        pytest.param(
            {"seconds_without_progress": 301},
            FailureKind.HANG,
            id="no progress past the timeout is a hang",
        ),
        pytest.param(
            {"seconds_without_progress": 300},
            None,
            id="no progress up to the timeout is still healthy",
        ),
        pytest.param(
            {"process_exited": True, "seconds_without_progress": 900},
            FailureKind.SOFTWARE,
            id="a crash explains the missing progress",
        ),
    ],
)
def test_classify_failure(observed: dict[str, Any], kind: FailureKind | None) -> None:
    assert classify_failure(hang_timeout_seconds=300, **observed) is kind


def test_only_hardware_failures_need_replacement_pods() -> None:
    assert [k.needs_replacement for k in FailureKind] == [False, True, False]


def test_the_job_level_kind_is_the_worst() -> None:
    assert worst_failure([None, FailureKind.HANG, FailureKind.SOFTWARE]) is FailureKind.SOFTWARE
    assert worst_failure([FailureKind.SOFTWARE, FailureKind.HARDWARE]) is FailureKind.HARDWARE
    assert worst_failure([None]) is None


def inventory(
    placement: Placement, versions: Iterable[int], skip: Iterable[tuple[int, int, int]] = ()
) -> list[ShardCopy]:
    """Every holder holds every version complete, except (rank, version, holder) in `skip`."""
    skipped = set(skip)
    return [
        ShardCopy(rank, v, holder, True, f"sum-{rank}-{v}")
        for rank, holders in placement.holders.items()
        for holder in holders
        for v in versions
        if (rank, v, holder) not in skipped
    ]


P8 = mixed_placement(8, 2)  # pairs (0,1) (2,3) (4,5) (6,7)


def test_a_software_failure_restores_every_rank_from_its_own_memory() -> None:
    plan = plan_recovery(2, P8, [3], [], inventory(P8, [4, 5]), [2])
    assert (plan.mode, plan.version, plan.replace_ranks) == ("memory", 5, ())
    assert {s.kind for s in plan.sources.values()} == {"local"}
    assert plan.restart_ranks == tuple(range(8))
    assert "restart 1 failed ranks in place" in plan.reason


def test_a_lost_machine_is_replaced_fetches_from_its_peer_and_refetches_what_it_held() -> None:
    plan = plan_recovery(2, P8, [3], [3], inventory(P8, [4, 5]), [2])
    assert plan.mode == "memory" and plan.version == 5
    assert plan.replace_ranks == (3,)
    assert plan.sources[3].kind == "peer" and plan.sources[3].holder == 2
    assert plan.sources[3].checksum == "sum-3-5"
    assert dict(plan.refetch) == {3: (2,)}
    assert plan.replica_source(2) == 2


def test_losing_a_whole_group_falls_back_to_the_newest_s3_version() -> None:
    plan = plan_recovery(2, P8, [2, 3], [2, 3], inventory(P8, [4, 5]), [1, 3, 2])
    assert (plan.mode, plan.version) == ("s3", 3)
    assert {s.kind for s in plan.sources.values()} == {"s3"}
    assert "ranks: 2, 3" in plan.reason


def test_no_memory_and_no_s3_is_unrecoverable_with_a_reason() -> None:
    plan = plan_recovery(2, P8, [2, 3], [2, 3], inventory(P8, [5]), [])
    assert plan.mode == "unrecoverable" and not plan.recoverable
    assert plan.version is None and not plan.sources
    assert "lacks 2 ranks: 2, 3" in plan.reason and "S3 has no committed version" in plan.reason
    assert "complete copies of rank 2 at none, rank 3 at none" in plan.reason


def test_an_unrecoverable_reason_names_the_versions_surviving_memory_holds_of_a_lacking_rank(
) -> None:
    # Rank 1's node is lost; rank 0 kept version 4 only, rank 0's node holds rank 1's 5 only.
    held = inventory(P8, [4, 5], skip=[(0, 5, 0), (1, 4, 0)])
    plan = plan_recovery(2, P8, [1], [1], held, [])
    assert plan.mode == "unrecoverable"
    assert "version 5 lacks 1 ranks: 0; complete copies of rank 0 at 4)" in plan.reason


def test_nothing_saved_anywhere_is_unrecoverable() -> None:
    plan = plan_recovery(2, P8, [0], [], [], [])
    assert plan.mode == "unrecoverable"
    assert "no complete checkpoint" in plan.reason


def test_a_version_complete_for_only_some_ranks_is_never_mixed_in() -> None:
    # Version 6 reached ranks 0-5 only; restore version 5 everywhere, not 6 for some ranks.
    partial = [(r, 6, h) for r in (6, 7) for h in P8.holders[r]]
    plan = plan_recovery(2, P8, [1], [], inventory(P8, [5, 6], skip=partial), [])
    assert plan.version == 5
    assert {s.checksum for s in plan.sources.values()} == {f"sum-{r}-5" for r in range(8)}


def test_incomplete_copies_are_not_sources() -> None:
    copies = inventory(P8, [5])
    copies = [c if (c.rank, c.holder) != (2, 3) else ShardCopy(2, 5, 3, False, "") for c in copies]
    plan = plan_recovery(2, P8, [2], [2], copies, [4])
    assert (plan.mode, plan.version) == ("s3", 4)


def test_a_newer_s3_version_wins_over_older_memory() -> None:
    plan = plan_recovery(2, P8, [0], [], inventory(P8, [5]), [7])
    assert (plan.mode, plan.version) == ("s3", 7)
    assert "newer than version 5" in plan.reason


def test_copies_from_lost_holders_are_ignored() -> None:
    plan = plan_recovery(2, P8, [0, 1], [0, 1], inventory(P8, [5]), [])
    assert plan.mode == "unrecoverable"


@pytest.mark.parametrize(
    ("lost", "expected"),
    [
        pytest.param([], ("local", 2, "own"), id="the owner's own checksum wins a disagreement"),
        pytest.param([2], ("peer", 3, "peer"), id="with the owner lost the remaining copy serves"),
    ],
)
def test_checksum_disagreement_trusts_the_owner(lost: list[int], expected: tuple[Any, ...]) -> None:
    copies = [c for c in inventory(P8, [5]) if c.rank != 2]
    copies += [ShardCopy(2, 5, 2, True, "own"), ShardCopy(2, 5, 3, True, "peer")]
    source = plan_recovery(2, P8, [2], lost, copies, []).sources[2]
    assert (source.kind, source.holder, source.checksum) == expected


def test_a_checksum_tie_without_the_owner_leaves_the_shard_to_s3() -> None:
    placement = mixed_placement(3, 3)
    copies = inventory(placement, [5], skip=[(0, 5, 0)])
    copies = [c for c in copies if c.rank != 0] + [
        ShardCopy(0, 5, 1, True, "a"),
        ShardCopy(0, 5, 2, True, "b"),
    ]
    plan = plan_recovery(3, placement, [0], [0], copies, [1])
    assert (plan.mode, plan.version) == ("s3", 1)


def test_a_checksum_majority_wins_without_the_owner() -> None:
    placement = mixed_placement(4, 4)
    copies = [c for c in inventory(placement, [5]) if c.rank != 0] + [
        ShardCopy(0, 5, 1, True, "x"),
        ShardCopy(0, 5, 2, True, "y"),
        ShardCopy(0, 5, 3, True, "y"),
    ]
    source = plan_recovery(4, placement, [0], [0], copies, []).sources[0]
    assert (source.kind, source.checksum) == ("peer", "y")


def test_fetches_are_spread_across_holders() -> None:
    placement = mixed_placement(4, 4)  # everyone holds everyone's shard
    plan = plan_recovery(4, placement, [0, 1], [0, 1], inventory(placement, [5]), [])
    assert {plan.sources[0].holder, plan.sources[1].holder} == {2, 3}
    assert max(plan.peer_fetches().values()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param((3, P8, [0], [], [], []), "m=2", id="a replica count unlike the placement"),
        pytest.param(
            (2, P8, [9], [], [], []), r"ranks \[9\]", id="a failed rank outside the placement"
        ),
        pytest.param(
            (2, P8, [], [12], [], []), r"ranks \[12\]", id="a lost holder outside the placement"
        ),
    ],
)
def test_contradictory_inputs_raise(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(RecoveryPlanError, match=message):
        plan_recovery(*args)


# Checksums agree per (rank, version) here; disagreements have their own cases above.
copy_strategy = st.tuples(
    st.integers(0, 5), st.integers(1, 3), st.integers(0, 5), st.booleans()
).map(lambda t: ShardCopy(t[0], t[1], t[2], t[3], f"sum-{t[0]}-{t[1]}"))


@settings(max_examples=80, deadline=None)
@given(
    m=st.integers(1, 3),
    copies=st.lists(copy_strategy, max_size=60),
    lost=st.sets(st.integers(0, 5), max_size=3),
    s3=st.lists(st.integers(0, 3), max_size=2),
)
def test_plans_never_mix_versions_and_give_every_rank_a_source(m, copies, lost, s3) -> None:
    placement = mixed_placement(6, m)
    plan = plan_recovery(m, placement, lost, lost, copies, s3)
    assert plan.replace_ranks == tuple(sorted(lost))
    if plan.mode == "unrecoverable":
        assert plan.reason and not plan.sources and not s3
        return
    assert set(plan.sources) == set(range(6))
    if plan.mode == "s3":
        assert plan.version == max(s3)
        assert {s.kind for s in plan.sources.values()} == {"s3"}
        return
    assert plan.version is not None and (not s3 or plan.version >= max(s3))
    for rank, source in plan.sources.items():
        assert source.holder is not None and source.holder not in lost
        assert ShardCopy(rank, plan.version, source.holder, True, source.checksum or "") in copies
        assert source.kind == ("local" if source.holder == rank else "peer")
    # No newer version was complete for every rank on surviving holders.
    for newer in range(plan.version + 1, 4):
        covered = {
            c.rank for c in copies if c.version == newer and c.complete and c.holder not in lost
        }
        assert covered != set(range(6))
