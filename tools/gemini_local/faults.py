"""Fault injection on the local cluster: crash a container, lose a node, cut a node off.

- kill_container: signal a container's process group, as a software crash would.
- lose_node: SIGKILL the node's agent and every process it started at once (a power loss);
  the Node stops heart-beating and the control plane notices on its own.
- partition_node / heal_node: nftables rules that drop every packet between the node's
  processes (agent and containers, recognised by the node's group id, and its /24 of loopback
  addresses) and the rest; the agent's API traffic is cut with it. Needs root and `nft`, and
  connection tracking on from the node's start (track_connections, done by start_node_agent).
- add_node: start a fresh node agent (a spare) and wait until its Node is registered.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from gemini_local import nodes
from gemini_local.nodeagent.addressing import NodeNetwork
from gemini_local.pki import Pki


class FaultError(RuntimeError):
    """A fault cannot be injected as asked; the message says why."""


def kill_container(
    state_dir: Path, namespace: str, pod: str, container: str, sig: int = signal.SIGKILL
) -> int:
    """Send `sig` to a running container (SIGKILL: its whole process group); return its pid."""
    pattern = f"nodes/*/pods/{namespace}_{pod}_*/containers/{container}.pid"
    for pid_file in sorted(state_dir.glob(pattern)):
        try:
            pid = int(pid_file.read_text().split()[0])
            if sig == signal.SIGKILL:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
            return pid
        except (OSError, ValueError, IndexError):
            continue
    raise FaultError(f"container {container!r} of pod {namespace}/{pod} is not running on any "
                     f"local node of {state_dir}")


def lose_node(state_dir: Path, node: str) -> int:
    """Power loss: kill the node's agent and all its processes at once; return how many."""
    nodes.node_config(state_dir, node)  # an unknown node is named as such
    if nodes.running_agent_pid(state_dir, node) is None:
        raise FaultError(f"node {node!r} is not running (already lost or stopped)")
    return nodes.kill_node_processes(state_dir, node)


def _table(state_dir: Path, node: str) -> tuple[str, NodeNetwork, int | None]:
    config = nodes.node_config(state_dir, node)
    net = NodeNetwork.of_node_ip(config.node_ip, config.spec.index)
    return f"gemini_{net.octet}_{net.index}", net, config.gid


def _nft(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    if shutil.which("nft") is None:
        raise FaultError("network partitions need nftables: apt-get install -y nftables")
    return subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True,
                          check=False)


def _replace_table(table: str, rules: list[str], what: str) -> None:
    """(Re)create `inet <table>` with one output chain of `rules`."""
    chain = "".join(f"    {rule}\n" for rule in rules)
    _nft(["delete", "table", "inet", table])
    result = _nft(["-f", "-"], f"table inet {table} {{\n  chain output {{\n{chain}  }}\n}}\n")
    if result.returncode != 0:
        raise FaultError(f"nft refused the {what}: {result.stderr.strip()}")


def _track_table(state_dir: Path, node: str) -> str:
    return _table(state_dir, node)[0] + "_track"


def partition_node(state_dir: Path, node: str) -> None:
    """Cut the node off: its processes reach nothing outside its /24, nothing reaches them."""
    table, net, gid = _table(state_dir, node)
    if gid is None or os.geteuid() != 0:
        raise FaultError("network partitions need root: the node's processes must run with "
                         "their own group id (start the cluster as root)")
    # Packets leaving the node's processes for elsewhere are dropped (replies inside
    # connections that other node-local processes opened stay allowed), and so are packets
    # from anyone else to the node's addresses; the node's processes get no IPv6 (::1) at all.
    _replace_table(table, [
        "type filter hook output priority -10; policy accept;",
        f"meta skgid {gid} ct direction original ip daddr != {net.cidr} counter drop",
        f"ip daddr {net.cidr} ip saddr != {net.cidr} meta skgid != {gid} counter drop",
        f"meta nfproto ipv6 meta skgid {gid} counter drop",
    ], "partition rules")


def track_connections(state_dir: Path, node: str) -> None:
    """Turn connection tracking on for the node's life (call before its processes connect).

    Without a rule that uses conntrack, the kernel tracks nothing; a partition's rules would
    then pick up established connections mid-stream, taking whichever end sends first for the
    one that opened it, and let the other end's packets through as replies. Nothing happens
    without root or nft (then no partition is possible either).
    """
    if os.geteuid() == 0 and shutil.which("nft") is not None:
        _replace_table(_track_table(state_dir, node), [
            "type filter hook output priority -20; policy accept;", "ct state new counter",
        ], "connection-tracking table")


def untrack_connections(state_dir: Path, node: str) -> None:
    if shutil.which("nft") is not None:
        _nft(["delete", "table", "inet", _track_table(state_dir, node)])


def heal_node(state_dir: Path, node: str, missing_ok: bool = True) -> bool:
    """Lift a partition; True if the node was partitioned."""
    table, _, _ = _table(state_dir, node)
    if shutil.which("nft") is None:
        if missing_ok:
            return False
        raise FaultError("nftables is not installed, so no node can be partitioned")
    result = _nft(["delete", "table", "inet", table])
    if result.returncode != 0 and not missing_ok:
        raise FaultError(f"node {node!r} is not partitioned")
    return result.returncode == 0


def is_partitioned(state_dir: Path, node: str) -> bool:
    table, _, _ = _table(state_dir, node)
    if shutil.which("nft") is None:
        return False
    return _nft(["list", "table", "inet", table]).returncode == 0


def add_node(kubeconfig: Path, pki: Pki, state_dir: Path, spec: nodes.NodeSpec,
             timeout: float = 30.0) -> int:
    """Start a fresh node (a spare) and wait until its Node is registered; return its pid."""
    pid = nodes.start_node_agent(kubeconfig, pki, state_dir, spec)
    nodes.wait_for_node_agents(state_dir, [spec.name], timeout)
    return pid
