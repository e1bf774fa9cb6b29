"""Telling an out-of-memory kill from other SIGKILLs by the container's memory cgroup."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from gemini.control import OUT_OF_MEMORY
from gemini_trainer.oom import MemoryCgroup, describe


def _v1(root: Path, kills: int, limit: int) -> MemoryCgroup:
    (root / "memory").mkdir(parents=True, exist_ok=True)
    (root / "memory" / "memory.oom_control").write_text(
        f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    return MemoryCgroup(root)


def _v2(root: Path, kills: int, limit: str) -> MemoryCgroup:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills}\n")
    (root / "memory.max").write_text(f"{limit}\n")
    return MemoryCgroup(root)


def test_a_sigkill_while_the_v1_count_grew_names_the_limit(tmp_path: Path) -> None:
    cgroup = _v1(tmp_path, 1, 256 << 20)
    said = describe(-signal.SIGKILL, 0, cgroup)
    assert said is not None and said.startswith(OUT_OF_MEMORY)
    assert "memory limit (256 MiB)" in said and "resources.limits.memory" in said


def test_v2_counts_too_and_no_limit_says_the_node_ran_out(tmp_path: Path) -> None:
    cgroup = _v2(tmp_path, 2, "max")
    assert cgroup.oom_kills() == 2 and cgroup.limit() is None
    said = describe(-signal.SIGKILL, 1, cgroup)
    assert said is not None and "the memory the node had left" in said


@pytest.mark.parametrize(("code", "before", "kills"), [
    pytest.param(-signal.SIGKILL, 1, 1, id="a SIGKILL with no new OOM kill (a user's kill -9)"),
    pytest.param(1, 0, 1, id="an error exit while another process was OOM-killed"),
    pytest.param(-signal.SIGKILL, None, 1, id="no count at the start"),
])
def test_other_exits_are_not_out_of_memory(tmp_path: Path, code: int, before: int | None,
                                           kills: int) -> None:
    assert describe(code, before, _v1(tmp_path, kills, 1 << 30)) is None


def test_without_a_memory_cgroup_nothing_is_known(tmp_path: Path) -> None:
    cgroup = MemoryCgroup(tmp_path)
    assert cgroup.oom_kills() is None and cgroup.limit() is None
    assert describe(-signal.SIGKILL, 0, cgroup) is None
    assert _v1(tmp_path / "big", 0, (1 << 63) - 4096).limit() is None  # v1's "no limit"
