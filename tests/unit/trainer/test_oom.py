"""Telling an out-of-memory kill from other SIGKILLs by the container's memory cgroup."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from gemini.control.launcher import OUT_OF_MEMORY
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


def test_the_process_own_cgroup_is_read_where_the_mount_shows_the_whole_tree(
        tmp_path: Path) -> None:
    """A node agent's process (no cgroup namespace): the OOM kill is counted in its own
    cgroup, not at the root, which counts none (seen on this machine: root 0, own 25)."""
    table = tmp_path / "cgroup"
    table.write_text("9:name=systemd:/\n4:memory:/sandbox/abc\n1:cpu:/\n0::/\n")
    mounted = tmp_path / "fs"
    _v1(mounted, 0, (1 << 63) - 4096)
    own_folder = mounted / "memory" / "sandbox" / "abc"
    own_folder.mkdir(parents=True)
    (own_folder / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (own_folder / "memory.limit_in_bytes").write_text(f"{512 << 20}\n")
    own = MemoryCgroup.of_this_process(mounted, table)
    assert own.oom_kills() == 3 and own.limit() == 512 << 20
    assert MemoryCgroup(mounted).oom_kills() == 0


def test_inside_a_container_the_mount_root_is_the_process_own_cgroup(tmp_path: Path) -> None:
    """v1 without a cgroup namespace: the table names the host's path, the mount shows only
    the container's folder; v2 with one: the table says /."""
    table = tmp_path / "cgroup"
    table.write_text("4:memory,foo:/kubepods/pod1/c1\n0::/\n")
    cgroup = MemoryCgroup.of_this_process(_v1(tmp_path / "v1", 2, 1 << 30).root, table)
    assert cgroup.v1_path == "/kubepods/pod1/c1" and cgroup.oom_kills() == 2
    table.write_text("0::/\n")
    cgroup = MemoryCgroup.of_this_process(_v2(tmp_path / "v2", 4, "max").root, table)
    assert cgroup.oom_kills() == 4
    assert MemoryCgroup.of_this_process(tmp_path / "none", tmp_path / "absent").oom_kills() is None
