"""The node payload of several processes per node, and the budget check of a first snapshot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from gemini.slots.layout import PAGE, SlotError
from gemini.slots.shard import ShardSlots
from gemini_trainer.checkpointer_config import CheckpointerConfig, check_budget
from gemini_trainer.local_group import LocalGroup, local_env
from gemini_trainer.node_shard import NodeLayout, node_regions, region_payload, region_span


def node_payload(regions: list[bytes]) -> bytearray:
    layout = NodeLayout(tuple(region_span(len(r)) for r in regions))
    payload = bytearray(layout.total)
    crcs = []
    for i, data in enumerate(regions):
        start = layout.offset(i)
        payload[start : start + len(data)] = data
        crcs.append(zlib.crc32(payload[start : start + layout.spans[i]]))
    index = layout.encode_index(crcs)
    payload[:PAGE] = index
    assert layout.checksum(zlib.crc32(index), crcs) == zlib.crc32(payload)
    return payload


def test_the_combined_checksum_is_the_crc_of_the_whole_payload_and_regions_read_back() -> None:
    regions = [os.urandom(1000), os.urandom(70_000), b"", os.urandom(5)]
    payload = memoryview(node_payload(regions))
    assert [span for _, span, _ in node_regions(payload)] == [region_span(len(r))
                                                              for r in regions]
    for i, data in enumerate(regions):
        assert bytes(region_payload(payload, i, len(regions))[: len(data)]) == data


def test_a_corrupt_region_or_another_process_count_is_refused() -> None:
    payload = node_payload([b"a" * 100, b"b" * 100])
    view = memoryview(payload)
    with pytest.raises(SlotError, match="holds 2 processes' shards, this node runs 4"):
        region_payload(view, 0, 4)
    offset = node_regions(view)[1][0]
    payload[offset + 3] ^= 0xFF
    assert bytes(region_payload(view, 0, 2)[:100]) == b"a" * 100
    with pytest.raises(SlotError, match="local rank 1's region fails its CRC-32"):
        region_payload(view, 1, 2)
    with pytest.raises(SlotError, match="not a node checkpoint"):
        region_payload(memoryview(bytearray(PAGE * 2)), 0, 2)


def test_the_coordination_words_live_in_the_file_header_page(tmp_path: Path) -> None:
    with ShardSlots(tmp_path / "s", 1 << 16) as a, ShardSlots(tmp_path / "s") as b:
        a.publish_begin(7 << 32 | 3)
        a.publish_region(63, 11, 0xFFFFFFFF)
        assert b.begin_key == 7 << 32 | 3 and b.region_done(63) == (11, 0xFFFFFFFF)
        a.begin(5, 4096).release()
        info, array = b.writing_array(5)
        assert info.version == 5 and isinstance(array, np.ndarray) and array.size == 4096
        del array  # a view of the mapping: released before the file is closed
        assert b.acknowledged_seq == 0 and b.pinned_seq == 0  # neighbours untouched
        a.abort()


def config(procs: int, budget: int | None, replicas: int) -> CheckpointerConfig:
    return CheckpointerConfig(rank=procs - 1, world_size=procs, shm_dir=Path("/tmp"),
                              local_rank=procs - 1, local_world_size=procs, node_rank=0,
                              memory_budget_bytes=budget, replicas=replicas)


def test_a_node_checkpoint_the_budget_cannot_hold_is_refused_with_the_rule() -> None:
    check_budget(config(8, 4 << 30, 2), 1 << 30)  # 2 versions of 1 GiB fit 4 GiB
    check_budget(config(8, None, 3), 1 << 40)  # no budget given: nothing to check
    with pytest.raises(SlotError, match=r"8 processes' shards, numProcPerNode\) needs "
                       r"1073741824 bytes per version, so 4 versions"):
        check_budget(config(8, 3 << 30, 3), 1 << 30)


def test_local_ranks_get_the_torchrun_environment_numbered_node_by_node() -> None:
    env = local_env({"GEMINI_RANK": "3", "GEMINI_WORLD_SIZE": "4", "X": "y"}, 5, 8)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "NODE_RANK", "X")} == {
        "RANK": "29", "WORLD_SIZE": "32", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
        "NODE_RANK": "3", "X": "y"}
    with pytest.raises(ValueError, match="rank 5 is not node rank 1 x 2"):
        CheckpointerConfig(rank=5, world_size=8, shm_dir=Path("/tmp"), local_rank=0,
                           local_world_size=2, node_rank=1)


def spawn(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_the_first_failure_stops_the_other_local_processes_and_is_the_groups_code() -> None:
    group = LocalGroup([spawn("import time; time.sleep(60)"), spawn("raise SystemExit(3)"),
                        spawn("import time; time.sleep(60)")], grace_s=5)
    start = time.monotonic()
    assert group.wait(timeout=30) == 3
    assert time.monotonic() - start < 10
    assert all(p.poll() is not None for p in group.procs)


def test_a_group_succeeds_when_every_process_exits_zero() -> None:
    group = LocalGroup([spawn("pass"), spawn("import time; time.sleep(0.3)")], grace_s=5)
    assert group.wait(timeout=30) == 0


def test_a_stopped_process_is_ended_without_waiting_out_the_grace_period() -> None:
    """A hung local process (here stopped) gets SIGTERM and SIGCONT: it ends at once rather
    than at the grace period's SIGKILL."""
    stopped = spawn("import time; time.sleep(60)")
    os.killpg(stopped.pid, signal.SIGSTOP)
    group = LocalGroup([stopped, spawn("import time; time.sleep(0.5); raise SystemExit(3)")],
                       grace_s=30)
    start = time.monotonic()
    assert group.wait(timeout=60) == 3
    assert time.monotonic() - start < 10
    assert stopped.returncode == -signal.SIGTERM
