"""Slot rules of the shared-memory shard file: completeness, checksums, never losing the newest."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gemini.slots.layout import PAGE, SlotBusy, SlotError, SlotState, payload_checksum
from gemini.slots.shard import ShardSlots
from gemini_trainer.payload import as_numpy, encoded_size, read_payload, write_payload


@pytest.fixture()
def slots(tmp_path: Path) -> Iterator[ShardSlots]:
    s = ShardSlots(tmp_path / "rank0.slots", 1 << 18, rank=0)
    yield s
    s.close()


def write_version(slots: ShardSlots, version: int, fill: int, nbytes: int = 4096) -> None:
    view = slots.begin(version, nbytes)
    view[:] = bytes([fill]) * nbytes
    view.release()
    slots.commit(version)


def test_fresh_file_has_no_complete_version(slots: ShardSlots) -> None:
    assert slots.latest_complete() is None
    assert [i.state for i in slots.slot_info()] == [SlotState.EMPTY, SlotState.EMPTY]


def test_a_committed_version_reads_back_with_its_bytes_and_checksum(slots: ShardSlots) -> None:
    write_version(slots, 7, 0xAB)
    info = slots.latest_complete()
    assert info is not None and info.version == 7 and info.payload_len == 4096
    view = slots.read(7, verify=True)
    assert bytes(view) == b"\xab" * 4096
    assert info.checksum == payload_checksum(b"\xab" * 4096)


def test_a_half_written_version_is_never_returned_as_complete(slots: ShardSlots) -> None:
    write_version(slots, 1, 1)
    view = slots.begin(2, 4096)
    view[:100] = b"\x02" * 100  # the writer dies here: payload half written, no commit
    view.release()
    latest = slots.latest_complete()
    assert latest is not None and latest.version == 1
    assert slots.find(2) is None
    with pytest.raises(SlotError, match="not complete"):
        slots.read(2)
    states = sorted(i.state for i in slots.slot_info())
    assert states == [SlotState.WRITING, SlotState.COMPLETE]


def test_a_writer_killed_mid_write_leaves_the_previous_version_complete(tmp_path: Path) -> None:
    path = tmp_path / "killed.slots"
    with ShardSlots(path, 1 << 20) as s:
        write_version(s, 10, 10, 1 << 20)
    code = (
        "import os, sys; from gemini.slots.shard import ShardSlots\n"
        f"s = ShardSlots({str(path)!r})\n"
        "v = s.begin(11, 1 << 20); v[: 1 << 19] = b'x' * (1 << 19)\n"
        "os._exit(9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), check=False)
    assert proc.returncode == 9
    with ShardSlots(path) as s:
        latest = s.latest_complete()
        assert latest is not None and latest.version == 10
        assert s.verify(10)
        write_version(s, 11, 11, 1 << 20)  # the lock died with the writer: a new one can write
        assert s.latest_complete().version == 11  # type: ignore[union-attr]


def test_the_newest_complete_version_is_never_overwritten_by_the_next_write(
    slots: ShardSlots,
) -> None:
    for version in range(1, 8):
        newest = slots.latest_complete()
        view = slots.begin(version, 4096)
        if newest is not None:
            writing = [i for i in slots.slot_info() if i.state is SlotState.WRITING]
            assert [i.index for i in writing] == [1 - newest.index]
            assert slots.verify(newest.version), "the newest complete version was touched"
        view[:] = bytes([version]) * 4096
        view.release()
        slots.commit(version)
        held = sorted(i.version for i in slots.slot_info() if i.complete)
        assert held == ([version - 1, version] if version > 1 else [1])


def test_newest_means_most_recently_committed_even_when_the_step_goes_back(
    slots: ShardSlots,
) -> None:
    write_version(slots, 20, 1)
    write_version(slots, 21, 2)
    write_version(slots, 5, 3)  # training rolled back to step 4 and went on: step 5 is newest
    latest = slots.latest_complete()
    assert latest is not None and latest.version == 5
    write_version(slots, 6, 4)
    assert sorted(i.version for i in slots.slot_info()) == [5, 6]


def test_a_corrupt_payload_is_detected_by_its_checksum(slots: ShardSlots, tmp_path: Path) -> None:
    write_version(slots, 3, 0x33)
    info = slots.latest_complete()
    assert info is not None
    with open(slots.path, "r+b") as f:  # flip one byte in the middle of the payload
        f.seek(PAGE + info.index * slots._stride + PAGE + 2000)
        f.write(b"\x00")
    assert not slots.verify(3)
    with pytest.raises(SlotError, match="CRC-32"):
        slots.read(3, verify=True)


def test_a_torn_header_reads_as_corrupt_not_complete(slots: ShardSlots) -> None:
    write_version(slots, 4, 4)
    info = slots.latest_complete()
    assert info is not None
    with open(slots.path, "r+b") as f:  # change the version field without fixing the header CRC
        f.seek(PAGE + info.index * slots._stride + 24)
        f.write(struct.pack("<q", 99))
    assert slots.latest_complete() is None
    assert slots.slot_info()[info.index].state is SlotState.CORRUPT


def test_put_refuses_a_received_version_with_the_wrong_checksum(slots: ShardSlots) -> None:
    write_version(slots, 1, 1)
    data = b"peer bytes" * 100
    with pytest.raises(SlotError, match="refused"):
        slots.put(2, [data[:500], data[500:]], checksum=payload_checksum(data) ^ 1)
    assert slots.latest_complete().version == 1  # type: ignore[union-attr]
    info = slots.put(2, [data[:500], data[500:]], checksum=payload_checksum(data))
    assert info.complete and bytes(slots.read(2, verify=True)) == data


def test_one_writer_at_a_time(slots: ShardSlots) -> None:
    other = ShardSlots(slots.path)
    try:
        slots.begin(1, 10).release()
        with pytest.raises(SlotBusy):
            other.begin(1, 10)
        slots.commit(1)
        other.begin(2, 10).release()
        other.commit(2)
    finally:
        other.close()


def test_a_version_larger_than_the_slot_is_refused_with_the_sizes(slots: ShardSlots) -> None:
    with pytest.raises(SlotError, match="larger capacity"):
        slots.begin(1, slots.capacity + 1)


def test_opening_with_another_capacity_is_refused(slots: ShardSlots) -> None:
    with pytest.raises(SlotError, match="another capacity"):
        ShardSlots(slots.path, 1 << 20)


def test_still_valid_notices_that_the_slot_was_reused(slots: ShardSlots) -> None:
    write_version(slots, 1, 1)
    info = slots.find(1)
    assert info is not None and slots.still_valid(info)
    write_version(slots, 2, 2)
    assert slots.still_valid(info)
    write_version(slots, 3, 3)  # reuses version 1's slot
    assert not slots.still_valid(info)


def test_payload_round_trip_keeps_arrays_dtypes_and_meta(slots: ShardSlots) -> None:
    rng = np.random.default_rng(0)
    arrays: dict[str, tuple[str, Any]] = {
        "w": ("<f4", rng.standard_normal((3, 5)).astype(np.float32)),
        "step": ("<i8", np.array(12, dtype=np.int64)),
        "bf16": ("torch.bfloat16", np.arange(7, dtype=np.uint16)),
    }
    meta = {"lr": 0.1 + 0.2, "betas": [0.9, 0.999], "name": "x"}
    nbytes = encoded_size(arrays, meta)
    slots.begin(9, nbytes).release()
    assert write_payload(slots.pending_array(), arrays, meta) == nbytes
    slots.commit(9)
    entries, views, got_meta = read_payload(slots.read(9, verify=True))
    assert got_meta == meta
    for name, (label, arr) in arrays.items():
        assert entries[name].dtype == label and entries[name].shape == arr.shape
        assert entries[name].offset % 64 == 0
    np.testing.assert_array_equal(as_numpy(entries["w"], views["w"]), arrays["w"][1])
    assert as_numpy(entries["step"], views["step"]) == 12
    assert views["bf16"].tobytes() == arrays["bf16"][1].tobytes()


def test_a_payload_without_an_index_is_refused() -> None:
    with pytest.raises(SlotError, match="index"):
        read_payload(b"\x00" * 64)


def test_after_restoring_an_older_version_the_newer_one_is_dropped_and_the_restored_kept(
    slots: ShardSlots,
) -> None:
    write_version(slots, 49, 0x49)
    write_version(slots, 50, 0x50)  # of the run that failed; training restarts from 49
    assert slots.drop_newer_than(49) == [50]
    assert slots.find(50) is None and slots.latest_complete().version == 49
    write_version(slots, 50, 0x51)  # the new run's 50 goes into the emptied slot
    assert sorted(i.version for i in slots.slot_info() if i.complete) == [49, 50]
    assert bytes(slots.read(50))[:1] == b"\x51"
    assert slots.drop_newer_than(50) == []


def test_dropping_newer_versions_is_refused_while_one_is_being_written(slots: ShardSlots) -> None:
    write_version(slots, 1, 0x01)
    slots.begin(2, 4096).release()
    with pytest.raises(SlotError, match="version 2 is being written"):
        slots.drop_newer_than(1)
