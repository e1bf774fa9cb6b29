"""A trainer crash as the paper means it: the training process dies, the pod and its launcher
stay. (faults.kill_container on the trainer container signals the launcher's process group,
and the launcher starts training in a session of its own, so that would orphan the training
process rather than crash it.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from gemini_local.faults import FaultError


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(p) for p in task.read_text().split()]
        except OSError:
            continue
    return found


def group_leaders_below(pid: int) -> list[int]:
    """Descendants of `pid` that lead a process group of their own (the launcher starts
    training that way), nearest first; robust to a wrapper between container and launcher."""
    found, queue = [], children(pid)
    while queue:
        child = queue.pop(0)
        try:
            if os.getpgid(child) == child:
                found.append(child)
                continue
        except ProcessLookupError:
            continue
        queue += children(child)
    return found


def kill_training_process(state_dir: Path, namespace: str, pod: str,
                          container: str = "trainer") -> int:
    """SIGKILL the process group of the command the container's launcher runs; its pid."""
    pattern = f"nodes/*/pods/{namespace}_{pod}_*/containers/{container}.pid"
    for pid_file in sorted(state_dir.glob(pattern)):
        try:
            launcher = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        for child in group_leaders_below(launcher):
            try:
                os.killpg(child, signal.SIGKILL)
                return child
            except ProcessLookupError:
                continue
    raise FaultError(f"no training process runs under the {container!r} container of "
                     f"{namespace}/{pod} in {state_dir}")
