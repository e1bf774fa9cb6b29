"""Replica store: two versions per rank, the newest complete never overwritten, a budget."""

from __future__ import annotations

import os

import pytest

from gemini_sidecar.checksum import crc32
from gemini_sidecar.store import BudgetExceeded, ReplicaStore, StoreError, WholeChecksumMismatch


def _receive(store: ReplicaStore, rank: int, version: int, data: bytes, chunk: int = 4096):
    store.begin(rank, version, len(data), source_checksum=version * 1000)
    for off in range(0, len(data), chunk):
        piece = data[off : off + chunk]
        store.chunk_view(rank, version, off, len(piece))[:] = piece
        store.chunk_done(rank, version, off, len(piece), crc32(piece))
    return store.finish(rank, version, crc32(data))


def test_the_newest_complete_version_survives_a_half_received_one():
    store = ReplicaStore(1 << 20)
    v1, v2, v3 = (os.urandom(10_000) for _ in range(3))
    _receive(store, 0, 1, v1)
    _receive(store, 0, 2, v2)
    store.begin(0, 3, len(v3), 3000)  # goes into v1's slot, never v2's
    store.chunk_view(0, 3, 0, 4096)[:] = v3[:4096]
    info, view = store.get(0)
    assert (info.version, bytes(view)) == (2, v2)
    assert [(r.version, r.complete) for r in store.inventory()] == [(2, True), (3, False)]
    with pytest.raises(StoreError, match="not complete"):
        store.get(0, 3)


def test_finish_refuses_missing_bytes_and_a_wrong_whole_checksum():
    store = ReplicaStore(1 << 20)
    data = os.urandom(8192)
    store.begin(1, 1, len(data), 0)
    store.chunk_view(1, 1, 0, 4096)[:] = data[:4096]
    store.chunk_done(1, 1, 0, 4096, crc32(data[:4096]))
    with pytest.raises(StoreError, match="4096 of 8192 bytes"):
        store.finish(1, 1, crc32(data))
    store.chunk_view(1, 1, 4096, 4096)[:] = data[4096:]
    store.chunk_done(1, 1, 4096, 4096, crc32(data[4096:]))
    with pytest.raises(WholeChecksumMismatch, match="CRC-32"):
        store.finish(1, 1, crc32(data) ^ 1)
    assert store.finish(1, 1, crc32(data)).complete


def test_a_chunk_that_landed_corrupt_is_caught_at_finish_and_healed_by_a_resend():
    store = ReplicaStore(1 << 20)
    data = os.urandom(8192)
    store.begin(0, 1, len(data), crc32(data))
    bad = bytearray(data[4096:])
    bad[100] ^= 0x01  # one bit flipped on the way
    for off, piece in ((0, data[:4096]), (4096, bytes(bad))):
        store.chunk_view(0, 1, off, len(piece))[:] = piece
        store.chunk_done(0, 1, off, len(piece), crc32(piece))
    with pytest.raises(WholeChecksumMismatch):
        store.finish(0, 1, crc32(data))
    assert not store.inventory()[0].complete  # still open: the sender resends that chunk
    store.chunk_view(0, 1, 4096, 4096)[:] = data[4096:]
    store.chunk_done(0, 1, 4096, 4096, crc32(data[4096:]))
    assert store.finish(0, 1, crc32(data)).complete
    assert bytes(store.get(0, 1)[1]) == data


def test_a_chunk_that_failed_its_mac_keeps_the_version_open_until_it_comes_again():
    store = ReplicaStore(1 << 20)
    data = os.urandom(8192)
    store.begin(0, 1, len(data), crc32(data))
    for off in (0, 4096):  # the second one's CRC-32 is right, but it failed its MAC
        store.chunk_view(0, 1, off, 4096)[:] = data[off : off + 4096]
        store.chunk_done(0, 1, off, 4096, crc32(data[off : off + 4096]))
    store.chunk_rejected(0, 1, 4096)
    with pytest.raises(WholeChecksumMismatch, match="1 chunks failed their keyed MAC"):
        store.finish(0, 1, crc32(data))
    assert not store.inventory()[0].complete
    store.chunk_view(0, 1, 4096, 4096)[:] = data[4096:]
    store.chunk_done(0, 1, 4096, 4096, crc32(data[4096:]))
    assert store.finish(0, 1, crc32(data)).complete


def test_chunks_outside_the_version_or_unaligned_are_refused():
    store = ReplicaStore(1 << 20)
    store.begin(0, 1, 100, 0)
    with pytest.raises(StoreError, match="outside"):
        store.chunk_view(0, 1, 96, 8)
    with pytest.raises(StoreError, match="multiples of 8"):
        store.chunk_view(0, 1, 4, 8)
    with pytest.raises(StoreError, match="not being received"):
        store.chunk_view(0, 2, 0, 8)


def test_a_version_beyond_the_budget_is_refused_and_the_complete_one_kept():
    store = ReplicaStore(15_000)
    first = os.urandom(10_000)
    _receive(store, 0, 1, first)
    with pytest.raises(BudgetExceeded, match="over its budget of 15000"):
        store.begin(0, 2, 10_000, 0)
    assert store.used_bytes == 10_000
    assert bytes(store.get(0, 1)[1]) == first
    store.drop(0)
    assert store.used_bytes == 0 and store.inventory() == []


def test_buffers_are_reused_once_both_slots_exist():
    store = ReplicaStore(20_000)
    for version in range(1, 6):
        _receive(store, 0, version, os.urandom(10_000))
    assert store.used_bytes == 20_000
    assert [r.version for r in store.inventory()] == [4, 5]


def test_a_version_from_a_restarted_owner_replaces_the_abandoned_copy_not_the_restored_one():
    store = ReplicaStore(1 << 20)
    v49, old50, new50, old51 = (os.urandom(10_000) for _ in range(4))
    _receive(store, 0, 49, v49)
    _receive(store, 0, 50, old50)  # then the job restores 49 and trains 50 again
    store.begin(0, 50, len(new50), 50_000)
    assert [(r.version, r.complete) for r in store.inventory()] == [(49, True), (50, False)]
    assert bytes(store.get(0, 49)[1]) == v49
    other = ReplicaStore(1 << 20)
    _receive(other, 0, 50, old50)
    _receive(other, 0, 51, old51)  # both of the abandoned run: never two copies of one version
    _receive(other, 0, 50, new50)
    assert bytes(other.get(0, 50)[1]) == new50
    assert sorted(r.version for r in other.inventory()) == [50, 51]


def test_a_resend_of_an_abandoned_version_does_not_wipe_a_refill_under_way():
    # A replacement holder refills the restored version 17 while a survivor, whose send of
    # its abandoned newest version 19 was restarted, begins version 19 again.
    store = ReplicaStore(1 << 20)
    v17, v19 = os.urandom(10_000), os.urandom(10_000)
    store.begin(0, 17, len(v17), 17000)
    store.chunk_view(0, 17, 0, 4096)[:] = v17[:4096]
    store.chunk_done(0, 17, 0, 4096, crc32(v17[:4096]))
    store.begin(0, 19, len(v19), 19000)  # the cleared slot
    store.begin(0, 19, len(v19), 19000)  # again: its own slot, never the refill's
    for off in range(4096, len(v17), 4096):
        piece = v17[off : off + 4096]
        store.chunk_view(0, 17, off, len(piece))[:] = piece
        store.chunk_done(0, 17, off, len(piece), crc32(piece))
    store.finish(0, 17, crc32(v17))
    _, view = store.get(0, 17)
    assert bytes(view) == v17
