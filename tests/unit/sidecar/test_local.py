"""The sidecar's handle on the local slot file: a version it writes leaves room for the next."""

from __future__ import annotations

from pathlib import Path

from gemini.slots.layout import SLOT_HEADROOM_BYTES, default_capacity
from gemini.slots.shard import ShardSlots
from gemini_sidecar.local import LocalShard


def test_a_slot_file_made_for_a_fetched_version_fits_the_restored_trainers_larger_snapshots(
    tmp_path: Path,
) -> None:
    local = LocalShard(tmp_path, rank=3, job="j")
    size = 70_000
    slots, view = local.begin_write(7, size)
    view[:] = b"\x01" * size
    view.release()
    slots.commit(7)
    local.close()
    assert slots.capacity == default_capacity(size) == size + SLOT_HEADROOM_BYTES

    # the restarted trainer opens the same file and writes a version whose extra state grew
    with ShardSlots(local.path) as trainer:
        bigger = size + SLOT_HEADROOM_BYTES // 2
        out = trainer.begin(8, bigger)
        out[:] = b"\x02" * bigger
        out.release()
        info = trainer.commit(8)
        assert (info.version, info.payload_len) == (8, bigger)
        assert trainer.find(7) is not None  # the fetched version is kept beside it
