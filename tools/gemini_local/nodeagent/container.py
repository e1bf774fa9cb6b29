"""One container of a pod as local processes: its state as the API shows it, logs, probes.

A container run is one process started in its own session (process group = pid), with its
output appended to `logs/<container>/<restart>.log`. Stopping sends SIGTERM to the process (as
a runtime signals PID 1), then SIGKILL to the whole group after the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gemini_local.nodeagent import procs
from gemini_local.nodeagent.podspec import ConfigError, Obj


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRun:
    """Runtime state of one container across its restarts."""

    spec: Obj
    kind: str  # "init", "sidecar" or "main"
    pod_dir: Path
    restart_count: int = 0
    runs: int = 0
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "PodInitializing"}})
    last_state: Obj = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    restarting: bool = False
    process: asyncio.subprocess.Process | None = None
    started_event: asyncio.Event = field(default_factory=asyncio.Event)
    crash_loop: int = 0

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def log_path(self, run: int) -> Path:
        return self.pod_dir / "logs" / self.name / f"{run}.log"

    @property
    def pid_file(self) -> Path:
        return self.pod_dir / "containers" / f"{self.name}.pid"

    def container_id(self, uid: str) -> str:
        return f"gemini://{uid[:8]}-{self.name}-{max(self.runs - 1, 0)}"

    def status(self, uid: str) -> Obj:
        out: Obj = {
            "name": self.name, "image": self.spec.get("image", ""), "imageID": "",
            "state": self.state, "lastState": self.last_state, "ready": self.ready,
            "restartCount": self.restart_count, "started": self.started,
        }
        if self.runs:
            out["containerID"] = self.container_id(uid)
        return out

    def set_waiting(self, reason: str, message: str = "") -> None:
        self.state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}


async def spawn(
    run: ContainerRun, argv: list[str], env: dict[str, str], cwd: Path, node_dir: Path
) -> asyncio.subprocess.Process:
    """Start one run of the container; its output goes to the run's log file."""
    log_path = run.log_path(run.runs)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                stderr=asyncio.subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
            )
        except OSError as err:
            raise ConfigError(f"cannot start {argv[0]!r}: {err}") from err
    procs.record_group(node_dir, proc.pid)
    run.pid_file.parent.mkdir(parents=True, exist_ok=True)
    run.pid_file.write_text(f"{proc.pid}\n")
    run.process = proc
    run.runs += 1
    return proc


# The kubelet's limits on a termination message taken from the log.
LOG_MESSAGE_LINES, LOG_MESSAGE_BYTES = 80, 2048


def fallback_message(run: ContainerRun, code: int) -> str:
    """The termination message as a kubelet gives it under FallbackToLogsOnError: the end of
    the failed run's log (the last 80 lines, at most 2 KiB); none for a success or another
    policy. (No terminationMessagePath file is read: nothing here writes one.)"""
    if code == 0 or run.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    try:
        data = run.log_path(run.runs - 1).read_bytes()[-LOG_MESSAGE_BYTES:]
    except OSError:
        return ""
    lines = data.decode(errors="replace").splitlines()[-LOG_MESSAGE_LINES:]
    return "\n".join(lines)


def exit_code(returncode: int) -> int:
    """Kubernetes' exit code: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def terminated_state(code: int, started_at: str, container_id: str, message: str = "") -> Obj:
    return {"terminated": {
        "exitCode": code, "reason": "Completed" if code == 0 else "Error",
        "startedAt": started_at, "finishedAt": now_iso(), "containerID": container_id,
        **({"signal": code - 128} if code > 128 else {}),
        **({"message": message} if message else {}),
    }}


async def stop_process(proc: asyncio.subprocess.Process, grace: float) -> None:
    """SIGTERM the container's process, SIGKILL its whole group after `grace` seconds."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), max(grace, 0.0))
    procs.kill_group(proc.pid)
    await proc.wait()


# --- probes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeTarget:
    pod_ip: str
    ports: dict[str, int]
    env: dict[str, str]
    exec_prefix: list[str]
    cwd: Path


def _port(value: Any, target: ProbeTarget) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    if value not in target.ports:
        raise ConfigError(f"probe names port {value!r}, which the container does not declare")
    return target.ports[value]


async def probe_once(probe: Obj, target: ProbeTarget, http: aiohttp.ClientSession) -> bool:
    """Run one exec/httpGet/tcpSocket check; True when it succeeds within timeoutSeconds."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "exec" in probe:
            return await _exec_probe(probe["exec"]["command"], target, timeout)
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = (f"{get.get('scheme', 'HTTP').lower()}://{get.get('host') or target.pod_ip}:"
                   f"{_port(get['port'], target)}{get.get('path', '/')}")
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            async with http.get(url, headers=headers, ssl=False,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return 200 <= resp.status < 400
        if "tcpSocket" in probe:
            sock = probe["tcpSocket"]
            host = sock.get("host") or target.pod_ip
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, _port(sock["port"], target)), timeout)
            writer.close()
            return True
        if "grpc" in probe:
            raise ConfigError("grpc probes are not supported by the local node agent")
    except (TimeoutError, OSError, aiohttp.ClientError):
        return False
    except ConfigError as err:  # e.g. a named port the container does not declare
        print(f"probe cannot run: {err}", flush=True)
        return False
    return False


async def _exec_probe(command: list[str], target: ProbeTarget, timeout: float) -> bool:
    proc = await asyncio.create_subprocess_exec(
        *target.exec_prefix, *command, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env=target.env, cwd=target.cwd, start_new_session=True,
    )
    try:
        return await asyncio.wait_for(proc.wait(), timeout) == 0
    except TimeoutError:
        return False
    finally:
        procs.kill_group(proc.pid)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            await proc.wait()


def exec_prefix(pid: int | None, mountns: bool) -> list[str]:
    """How an exec probe enters the container's mount namespace (nothing when there is none)."""
    if mountns and pid is not None and os.path.exists(f"/proc/{pid}/ns/mnt"):
        return ["nsenter", f"--target={pid}", "--mount", "--"]
    return []
