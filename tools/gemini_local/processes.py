"""Detached background processes tracked by pid files, for the local cluster's daemons.

Each daemon runs in its own session (so it outlives the command that started it and can be
killed as a group) and has `<pid_dir>/<name>.pid`; the pid file also records the executable,
so a recycled pid is never mistaken for our daemon.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def spawn(
    name: str, argv: Sequence[str], pid_dir: Path, log_dir: Path,
    env: Mapping[str, str] | None = None, group: int | None = None,
) -> int:
    """Start `argv` detached (with group id `group`, if given), output to
    `<log_dir>/<name>.log`; return its pid."""
    pid_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=dict(env) if env is not None else None, group=group,
        )
    record(name, proc.pid, argv[0], pid_dir)
    return proc.pid


def record(name: str, pid: int, executable: str, pid_dir: Path) -> None:
    """Remember process `pid` (the leader of its own session, running `executable`) as daemon
    `name`, for `running_pid` and `stop`."""
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"{name}.pid").write_text(f"{pid}\n{executable}\n")


def running_pid(name: str, pid_dir: Path) -> int | None:
    """The pid of daemon `name` if it is alive and still runs the recorded executable."""
    try:
        pid_text, exe = (pid_dir / f"{name}.pid").read_text().splitlines()[:2]
        pid = int(pid_text)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    if _state(stat) == "Z":
        return None
    # An empty command line is a process caught in the middle of exec: still ours.
    return pid if cmdline[0].decode() in (exe, "") else None


def stop(name: str, pid_dir: Path, grace_seconds: float = 5.0) -> bool:
    """SIGTERM the daemon's process group, SIGKILL after the grace period. False if not running."""
    pid = running_pid(name, pid_dir)
    (pid_dir / f"{name}.pid").unlink(missing_ok=True)
    if pid is None:
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and is_alive(pid):
        time.sleep(0.05)
    _signal_group(pid, signal.SIGKILL)
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def is_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        return _state(Path(f"/proc/{pid}/stat").read_text()) != "Z"
    except OSError:
        return False


def _state(stat: str) -> str:
    """The state letter of a /proc/<pid>/stat line (after the parenthesised command name)."""
    return stat.rsplit(")", 1)[-1].split()[0]


# Below the kernel's ephemeral range (32768-60999 by default) and Kubernetes' NodePorts
# (30000-32767): a port the OS hands out for bind(0) can be taken by any outgoing connection
# in the seconds before a slow server (torch's TCPStore) listens on it. Seen in CI.
_PORTS = range(20000, 30000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` that no outgoing connection will be given."""
    for port in random.sample(_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1} on {host}")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def torch_extensions_dir(venv_bin: str | os.PathLike[str]) -> str:
    """Where torch builds JIT ops (DeepSpeed's) for the environment of `venv_bin`: one folder
    per checkout, as ./dev sets it; builds from other paths in a shared one rebuild it."""
    return str(Path(venv_bin).parent / "torch-extensions")


def venv_tools_env(python: str, base: Mapping[str, str]) -> dict[str, str]:
    """`base` with the tools of `python`'s environment first on PATH and its JIT build folder:
    torch builds DeepSpeed's ops with the `ninja` on PATH, and two ninja versions (the venv's
    and Debian's) disagree on the build log's command hashes, so mixing them rebuilds the op
    (minutes, under a lock every DeepSpeed start waits on)."""
    bin_dir = Path(python).parent
    return {**base, "PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', '')}",
            "TORCH_EXTENSIONS_DIR": base.get("TORCH_EXTENSIONS_DIR")
            or torch_extensions_dir(bin_dir)}
