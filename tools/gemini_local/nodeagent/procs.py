"""The processes of a node: recorded process groups, and killing all of them at once.

Every container runs in its own session, so its process group id equals its pid; the agent
records each group as a file under `<node_dir>/pgids/`. When the agent runs as root, all of a
node's processes also share the node's group id, which finds even a process that left its
group (setsid) — a power loss must leave nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from gemini_local.processes import is_alive


def record_group(node_dir: Path, pgid: int) -> None:
    folder = node_dir / "pgids"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(pgid)).touch()


def forget_group(node_dir: Path, pgid: int) -> None:
    (node_dir / "pgids" / str(pgid)).unlink(missing_ok=True)


def recorded_groups(node_dir: Path) -> list[int]:
    folder = node_dir / "pgids"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


def pids_with_gid(gid: int) -> list[int]:
    """Live (non-zombie) processes whose real group id is `gid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if int(fields.get("Gid", "-1").split()[0]) == gid:
            found.append(int(entry.name))
    return found


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_node(node_dir: Path, gid: int | None, agent_pid: int | None, timeout: float = 5.0) -> int:
    """SIGKILL the agent and every process of the node, until none is left; return how many.

    `gid` is None when the node's processes do not have their own group (agent not root).
    """
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        targets = set(pids_with_gid(gid)) if gid is not None else set()
        if agent_pid is not None and is_alive(agent_pid):
            targets.add(agent_pid)
        groups = recorded_groups(node_dir)
        for pid in targets:
            _kill(pid)
        for pgid in groups:
            if kill_group(pgid):
                killed.add(pgid)
            forget_group(node_dir, pgid)
        killed |= targets
        if not targets and not groups:
            return len(killed)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(targets)} of {node_dir.name} survive SIGKILL")
        time.sleep(0.02)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)

