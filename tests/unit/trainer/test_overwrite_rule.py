"""The overwrite rule of the shard slots: the free slot is reused only when the newest
version is on every holder (acknowledged) and the free one is not pinned."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gemini.slots.shard import ShardSlots


@pytest.fixture()
def slots(tmp_path: Path) -> Iterator[ShardSlots]:
    s = ShardSlots(tmp_path / "rank0.slots", 1 << 16, rank=0)
    yield s
    s.close()


def commit(slots: ShardSlots, version: int) -> int:
    view = slots.begin(version, 4096)
    view[:] = bytes([version % 256]) * 4096
    view.release()
    return slots.commit(version).seq


def test_empty_or_half_empty_slots_may_always_be_written(slots: ShardSlots) -> None:
    assert slots.may_overwrite()
    commit(slots, 1)
    assert slots.may_overwrite()  # the free slot holds nothing


def test_the_older_version_stays_until_the_newer_is_acknowledged(slots: ShardSlots) -> None:
    commit(slots, 1)
    newest = commit(slots, 2)
    assert not slots.may_overwrite()  # version 1 is the only one every holder has
    slots.acknowledge(newest - 1)
    assert not slots.may_overwrite()
    slots.acknowledge(newest)
    assert slots.may_overwrite()


def test_a_pinned_free_slot_is_kept_and_released_by_unpinning(slots: ShardSlots) -> None:
    older = commit(slots, 1)
    newest = commit(slots, 2)
    slots.acknowledge(newest)
    slots.pin(older)
    assert not slots.may_overwrite()
    slots.pin(newest)  # pinning the newest keeps the free slot usable
    assert slots.may_overwrite()
    slots.pin(0)
    assert slots.may_overwrite()


def test_acknowledgements_never_go_back(slots: ShardSlots) -> None:
    slots.acknowledge(5)
    slots.acknowledge(3)
    assert slots.acknowledged_seq == 5


def test_an_acknowledgement_given_by_the_caller_overrides_the_sidecars(slots: ShardSlots) -> None:
    commit(slots, 1)
    newest = commit(slots, 2)
    assert slots.may_overwrite(acknowledged_seq=newest)  # a restored version is everywhere


def test_the_words_are_shared_between_mappings_of_one_file(tmp_path: Path) -> None:
    # The sidecar and the trainer map the same file in two processes.
    path = tmp_path / "rank3.slots"
    with ShardSlots(path, 1 << 16, rank=3) as trainer, ShardSlots(path) as sidecar:
        commit(trainer, 1)
        newest = commit(trainer, 2)
        assert not trainer.may_overwrite()
        sidecar.acknowledge(newest)
        assert trainer.may_overwrite()
        assert trainer.acknowledged_seq == newest
