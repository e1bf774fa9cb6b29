"""Replica store under a hostile (authenticated) sender (issue 14, item 7): begins with no
data after them never drop the last complete copy, and chunk records count in the budget."""

from __future__ import annotations

import os

import pytest

from gemini_sidecar.checksum import crc32
from gemini_sidecar.store import (
    FREE_RECORDS,
    RECORD_BYTES,
    BudgetExceeded,
    ReplicaStore,
    StoreError,
)
from tests.unit.sidecar.test_store import _receive


def _complete(store: ReplicaStore) -> list[int]:
    return [r.version for r in store.inventory() if r.complete]


@pytest.mark.parametrize("begins", [(5, 4), (5, 4, 3, 5, 4), (4, 4, 4), (3, 2, 1), (9, 6)])
def test_begins_alone_keep_a_complete_copy_and_the_newest_older_than_each(begins):
    store = ReplicaStore(1 << 20)
    v4, v5 = os.urandom(10_000), os.urandom(10_000)
    _receive(store, 0, 4, v4)
    _receive(store, 0, 5, v5)
    for version in begins:
        store.begin(0, version, 10_000, 0)
        assert _complete(store), f"no complete copy left after begin({version})"
    info, view = store.get(0)
    assert bytes(view) == (v5 if info.version == 5 else v4)
    older = [v for v in (4, 5) if v < min(begins)]
    if older:
        assert max(older) in _complete(store)  # what every one of them falls back to


def test_a_finished_retry_of_a_version_replaces_the_copy_kept_meanwhile():
    store = ReplicaStore(1 << 20)
    old, new = os.urandom(10_000), os.urandom(10_000)
    _receive(store, 0, 4, old)
    store.begin(0, 4, len(new), 0)  # the retry goes beside the complete copy
    assert bytes(store.get(0, 4)[1]) == old
    _receive(store, 0, 4, new)
    assert [(r.version, r.complete) for r in store.inventory()] == [(4, True)]
    assert bytes(store.get(0, 4)[1]) == new


def test_chunk_records_past_the_free_ones_count_in_the_budget():
    length = 64 * 1024
    store = ReplicaStore(length + 10 * RECORD_BYTES)
    store.begin(0, 1, length, 0)
    for i in range(FREE_RECORDS + 10):
        store.chunk_view(0, 1, 8 * i, 8)
        store.chunk_done(0, 1, 8 * i, 8, crc32(bytes(8)))
    assert store.used_bytes == length + 10 * RECORD_BYTES
    with pytest.raises(BudgetExceeded, match="its record would take the replica store"):
        store.chunk_view(0, 1, 8 * (FREE_RECORDS + 10), 8)
    store.chunk_view(0, 1, 0, 8)  # a chunk received again reuses its record


def test_empty_chunks_are_refused():
    store = ReplicaStore(1 << 20)
    store.begin(0, 1, 4096, 0)
    with pytest.raises(StoreError, match="chunks not empty"):
        store.chunk_view(0, 1, 0, 0)
