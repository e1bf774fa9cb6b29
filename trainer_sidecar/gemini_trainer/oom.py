"""Was the training process killed by the kernel's out-of-memory killer?

A container's memory limit is its cgroup's: at the limit the kernel kills the largest process
in it, which is the training process, not its launcher (PID 1). The container then never shows
`OOMKilled`; the process just ends by SIGKILL. The cgroup counts those kills (v1:
`memory.oom_control`'s `oom_kill`, v2: `memory.events`'s `oom_kill`): a SIGKILL while the count
grew is an out-of-memory kill. Outside a memory-limited container nothing is known (None).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from gemini.control.launcher import OUT_OF_MEMORY

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # v1 writes a huge number for "no limit"


@dataclass(frozen=True)
class MemoryCgroup:
    """The process's memory cgroup as mounted (v1 under memory/, v2 at the root): its own
    folder where the mount shows the whole tree (no cgroup namespace: the local node agent's
    processes, a container runtime sharing the host's view), else the mount's root, which in
    a container with its own view is the container's cgroup."""

    root: Path = CGROUP_ROOT
    v1_path: str = "/"  # the process's path in v1's memory hierarchy (/proc/self/cgroup)
    v2_path: str = "/"  # and in the unified one

    @classmethod
    def of_this_process(cls, root: Path = CGROUP_ROOT,
                        table: Path = Path("/proc/self/cgroup")) -> MemoryCgroup:
        v1 = v2 = "/"
        try:
            lines = table.read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if not controllers:
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
        return cls(root, v1, v2)

    @staticmethod
    def _own(mount: Path, path: str) -> Path:
        folder = mount / path.lstrip("/")
        return folder if folder.is_dir() else mount

    def _v1(self) -> Path:
        return self._own(self.root / "memory", self.v1_path)

    def _v2(self) -> Path:
        return self._own(self.root, self.v2_path)

    def oom_kills(self) -> int | None:
        for path in (self._v1() / "memory.oom_control", self._v2() / "memory.events"):
            try:
                for line in path.read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                continue
        return None

    def limit(self) -> int | None:
        for path in (self._v1() / "memory.limit_in_bytes", self._v2() / "memory.max"):
            try:
                text = path.read_text().strip()
            except OSError:
                continue
            if text == "max" or not text.isdigit() or int(text) >= _UNLIMITED:
                return None
            return int(text)
        return None


def describe(code: int, before: int | None, cgroup: MemoryCgroup) -> str | None:
    """What to say of a process that exited with `code` when the cgroup counted `before`
    kills at its start: a line starting with OUT_OF_MEMORY, or None if it was not that."""
    after = cgroup.oom_kills()
    if code != -signal.SIGKILL or before is None or after is None or after <= before:
        return None
    limit = cgroup.limit()
    where = (f"the container's memory limit ({limit / 2**20:.0f} MiB)" if limit
             else "the memory the node had left")
    return (f"{OUT_OF_MEMORY} the kernel's OOM killer ended the training process at {where}; "
            "raise the trainer container's resources.limits.memory or use less memory")
