"""Start and stop local node agents: one detached process per Node, outliving its caller.

Each node keeps everything under `<state_dir>/nodes/<name>/`: agent.json (its configuration),
agent.pid, agent.log, pgids/ (process groups of its containers) and pods/ (volumes, logs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from gemini_local import processes
from gemini_local.nodeagent import procs
from gemini_local.nodeagent.addressing import CLUSTER_OCTETS, NodeNetwork, cluster_octet
from gemini_local.nodeagent.agent import READY_MARKER
from gemini_local.nodeagent.config import AgentConfig, NodeSpec
from gemini_local.pki import Pki

__all__ = ["NodeAgentError", "NodeSpec", "node_config", "node_dir", "node_names",
           "running_agent_pid", "start_node_agent", "stop_all_node_agents", "stop_node_agent",
           "wait_for_node_agents"]

_AGENT = "agent"
# Claims on second octets of 127/8, so that two clusters on one machine never share addresses.
CLAIMS_DIR = Path("/tmp/gemini-local-net")
_CLAIM_GRACE_S = 60.0


class NodeAgentError(RuntimeError):
    """A node agent cannot be started or did not come up; the message says why."""


def node_dir(state_dir: Path, name: str) -> Path:
    return state_dir / "nodes" / name


def node_names(state_dir: Path) -> list[str]:
    """Every node ever started in `state_dir` (running or not)."""
    root = state_dir / "nodes"
    return sorted(p.name for p in root.iterdir() if (p / "agent.json").exists()) if root.exists() \
        else []


def node_config(state_dir: Path, name: str) -> AgentConfig:
    path = node_dir(state_dir, name) / "agent.json"
    if not path.exists():
        known = ", ".join(node_names(state_dir)) or "none"
        raise NodeAgentError(f"no node {name!r} in {state_dir} (known: {known})")
    return AgentConfig.load(path)


def running_agent_pid(state_dir: Path, name: str) -> int | None:
    return processes.running_pid(_AGENT, node_dir(state_dir, name))


def start_node_agent(kubeconfig: Path, pki: Pki, state_dir: Path, spec: NodeSpec) -> int:
    """Start the agent of `spec` detached (its own session); return its pid at once.

    Use `wait_for_node_agents` to wait until it has registered its Node.
    """
    from gemini_local.faults import track_connections  # faults imports this module

    folder = node_dir(state_dir, spec.name)
    if running_agent_pid(state_dir, spec.name) is not None:
        raise NodeAgentError(f"node {spec.name!r} already has a running agent; stop it first")
    _check_index_free(state_dir, spec)
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(kubeconfig, pki, state_dir, spec)
    config.save(folder / "agent.json")
    (folder / READY_MARKER).unlink(missing_ok=True)
    track_connections(state_dir, spec.name)  # before any of its processes connects
    argv = [sys.executable, "-m", "gemini_local.nodeagent", "--config", str(folder / "agent.json")]
    with open(folder / "agent.log", "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=folder, group=config.gid,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    (folder / f"{_AGENT}.pid").write_text(f"{proc.pid}\n{argv[0]}\n")
    return proc.pid


def _check_index_free(state_dir: Path, spec: NodeSpec) -> None:
    for other in node_names(state_dir):
        if other != spec.name and node_config(state_dir, other).spec.index == spec.index:
            raise NodeAgentError(f"node index {spec.index} is already used by node {other!r}; "
                                 "give every node of a cluster its own index")


def network_octet(state_dir: Path) -> int:
    """The cluster's second octet: recorded in the state dir, claimed machine-wide once."""
    record = state_dir / "nodes" / "network.json"
    if record.exists():
        return int(json.loads(record.read_text())["octet"])
    CLAIMS_DIR.mkdir(parents=True, exist_ok=True)
    first = cluster_octet(state_dir)
    for octet in sorted(CLUSTER_OCTETS, key=lambda o: (o - first) % len(CLUSTER_OCTETS)):
        if _claim(CLAIMS_DIR / str(octet), state_dir.resolve()):
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"octet": octet}))
            return octet
    raise NodeAgentError(f"all {len(CLUSTER_OCTETS)} local cluster address ranges are in use; "
                         f"stop other local clusters or clear stale claims in {CLAIMS_DIR}")


def shm_root(octet: int) -> Path:
    """The /dev/shm folder of the cluster on address range `octet` (one folder per node)."""
    return Path(f"/dev/shm/gemini-local-{octet}")


def _claim(path: Path, state_dir: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        owner = Path(path.read_text().strip() or "/nonexistent")
        if owner == state_dir:
            return True
        fresh = time.time() - path.stat().st_mtime < _CLAIM_GRACE_S  # its nodes may be starting
        if owner.exists() and (fresh or any(running_agent_pid(owner, n)
                                            for n in node_names(owner))):
            return False
        path.unlink(missing_ok=True)  # the owner is gone or runs no node: a stale claim
        return _claim(path, state_dir)
    with os.fdopen(fd, "w") as f:
        f.write(str(state_dir))
    _clear_range(int(path.name))
    return True


def _clear_range(octet: int) -> None:
    """What a cluster killed without `down` left on a range just claimed (nftables tables,
    node folders in /dev/shm) would be taken for the new cluster's own: remove it."""
    from gemini_local.faults import clear_octet_tables

    clear_octet_tables(octet)
    shutil.rmtree(shm_root(octet), ignore_errors=True)


def _config(kubeconfig: Path, pki: Pki, state_dir: Path, spec: NodeSpec) -> AgentConfig:
    net = NodeNetwork(network_octet(state_dir), spec.index)
    client_cert, client_key = pki.issue(
        f"node-{spec.name}-client", f"system:node:{spec.name}",
        ("system:nodes", "system:masters"), client=True)
    serving_cert, serving_key = pki.issue(
        f"node-{spec.name}-serving", f"system:node:{spec.name}", ips=(net.node_ip,),
        dns=(spec.name,), server=True)
    return AgentConfig(
        spec=spec, state_dir=str(state_dir.resolve()),
        node_dir=str(node_dir(state_dir, spec.name).resolve()),
        kubeconfig=str(kubeconfig.resolve()), client_cert=str(client_cert),
        client_key=str(client_key), serving_cert=str(serving_cert),
        serving_key=str(serving_key), ca_cert=str(pki.ca_cert), node_ip=net.node_ip,
        cidr=net.cidr, gid=net.gid if os.geteuid() == 0 else None,
        venv_bin=str(Path(sys.executable).parent),
        shm_dir=str(shm_root(net.octet) / spec.name),
    )


def wait_for_node_agents(state_dir: Path, names: Iterable[str], timeout: float = 30.0) -> None:
    """Wait until each agent has registered its Node; raise with its log if one died."""
    pending = set(names)
    deadline = time.monotonic() + timeout
    while pending:
        for name in list(pending):
            if (node_dir(state_dir, name) / READY_MARKER).exists():
                pending.discard(name)
            elif running_agent_pid(state_dir, name) is None:
                raise NodeAgentError(f"node agent {name!r} exited; {_log_tail(state_dir, name)}")
        if pending and time.monotonic() > deadline:
            raise NodeAgentError(f"node agents {sorted(pending)} not registered after "
                                 f"{timeout:.0f}s; {_log_tail(state_dir, sorted(pending)[0])}")
        time.sleep(0.05)


def _log_tail(state_dir: Path, name: str) -> str:
    log = node_dir(state_dir, name) / "agent.log"
    lines = log.read_text(errors="replace").splitlines()[-8:] if log.exists() else []
    return f"end of {log}:\n" + "\n".join(lines)


def kill_node_processes(state_dir: Path, name: str) -> int:
    """SIGKILL the node's agent and every process it started, all at once."""
    config = node_config(state_dir, name)
    pid = running_agent_pid(state_dir, name)
    return procs.kill_node(node_dir(state_dir, name), config.gid, pid)


def stop_node_agent(state_dir: Path, name: str) -> bool:
    """Stop the agent and all its containers, lift any partition; False if it was not running."""
    from gemini_local.faults import heal_node, untrack_connections

    was_running = running_agent_pid(state_dir, name) is not None
    kill_node_processes(state_dir, name)
    (node_dir(state_dir, name) / f"{_AGENT}.pid").unlink(missing_ok=True)
    heal_node(state_dir, name, missing_ok=True)
    untrack_connections(state_dir, name)
    shm_dir = Path(node_config(state_dir, name).shm_dir)
    shutil.rmtree(shm_dir, ignore_errors=True)
    remove_pod_tmp_dirs(node_dir(state_dir, name))
    with contextlib.suppress(OSError):
        shm_dir.parent.rmdir()  # the cluster's /dev/shm folder, once its last node is gone
    return was_running


def remove_pod_tmp_dirs(node_folder: Path) -> None:
    """The /tmp folders of the node's pods (`<ns>_<pod>_<uid>` under pods/): an agent killed
    with its node (a fault) could not remove them."""
    from gemini_local.nodeagent.pod import pod_tmp_dir

    for pod in (node_folder / "pods").glob("*_*_*"):
        shutil.rmtree(pod_tmp_dir(pod.name.rsplit("_", 1)[1]), ignore_errors=True)


def stop_all_node_agents(state_dir: Path) -> list[str]:
    """Stop every node of the cluster; return the names whose agent was running."""
    return [name for name in node_names(state_dir) if stop_node_agent(state_dir, name)]
