"""A trainer crash as the paper means it: the training process dies, the pod and its launcher
stay. (faults.kill_container on the trainer container signals the launcher's process group,
and the launcher starts training in a session of its own, so that would orphan the training
process rather than crash it.)"""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

from gemini_local.faults import FaultError, container_pids
from gemini_trainer.standby import STANDBY_NAME


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
    training that way), nearest first, but a launcher's waiting warm standby (also a group
    leader, named STANDBY_NAME until it takes a run); robust to a wrapper between container
    and launcher."""
    found, queue = [], children(pid)
    while queue:
        child = queue.pop(0)
        try:
            if os.getpgid(child) == child:
                if not is_waiting_standby(child):
                    found.append(child)
                continue
        except ProcessLookupError:
            continue
        queue += children(child)
    return found


def is_waiting_standby(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == STANDBY_NAME
    except OSError:
        return False


def kill_training_process(state_dir: Path, namespace: str, pod: str,
                          container: str = "trainer", sig: int = signal.SIGKILL) -> int:
    """Send `sig` (SIGKILL: a crash; SIGSTOP: a hang) to the process group of the command the
    container's launcher runs; its pid. Node agents' containers and real kubelet nodes'
    alike."""
    for launcher in container_pids(state_dir, namespace, pod, container):
        for child in group_leaders_below(launcher):
            try:
                os.killpg(child, sig)
                return child
            except ProcessLookupError:
                continue
    raise FaultError(f"no training process runs under the {container!r} container of "
                     f"{namespace}/{pod} in {state_dir}")


def launcher_gauge(core: Any, namespace: str, pod: str, name: str) -> float | None:
    """One gauge of the pod's launcher, from its /metrics (no token needed); None while the
    pod, its address or the gauge cannot be read."""
    try:
        found = core.read_namespaced_pod(pod, namespace)
        ports = [p.container_port for c in found.spec.containers for p in c.ports or []
                 if p.name == "launcher"]
        if not ports or not found.status.pod_ip:
            return None
        url = f"http://{found.status.pod_ip}:{ports[0]}/metrics"
        with urllib.request.urlopen(url, timeout=2) as answer:
            text = answer.read().decode(errors="replace")
    except Exception:  # any failure reads as "not known yet"
        return None
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None
