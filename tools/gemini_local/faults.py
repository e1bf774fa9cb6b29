"""Fault injection on the local cluster: crash a container, lose a node, cut or slow a node's link.

- kill_container: signal a container's process group, as a software crash would.
- lose_node: SIGKILL the node's agent and every process it started at once (a power loss);
  the Node stops heart-beating and the control plane notices on its own.
- partition_node / heal_node: nftables rules that drop every packet between the node's
  processes (agent and containers, recognised by the node's group id, and its /24 of loopback
  addresses) and the rest; the agent's API traffic is cut with it. Needs root and `nft`, and
  connection tracking on from the node's start (track_connections, done by start_node_agent).
- slow_link: police the node's traffic with the rest to a rate, each direction on its own
  (nftables `limit rate over` drops what exceeds it; TCP backs off to about the rate).
  heal_node ends a slow link and a partition alike.
- add_node: start a fresh node agent (a spare) and wait until its Node is registered.

On real kubelet nodes (`gemini local up --kubelet`) a crash goes through containerd (the task's
processes signalled), a power loss kills the node's kubelet, containerd, shims and every process
in its cgroup, and a partition drops forwarded packets between the node's pod subnet and the
rest and the kubelet's own traffic (its group id), and a slow link polices the forwarded
packets between the node's pods and other nodes' pods, each way.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from gemini_local import kubelet, nodes
from gemini_local.nodeagent.addressing import NodeNetwork
from gemini_local.pki import Pki

# nftables' byte bucket holds one second of the rate plus this burst; the burst keeps it above
# any packet on lo (GSO sends up to 64 KiB at once), which a smaller bucket would drop forever.
SLOW_LINK_BURST_BYTES = 64 * 1024
_PREFIXES = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_RATE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([kKMGT]i?|)(bit|B|)(/s)?$")


class FaultError(RuntimeError):
    """A fault cannot be injected as asked; the message says why."""


def kill_container(
    state_dir: Path, namespace: str, pod: str, container: str, sig: int = signal.SIGKILL
) -> int:
    """Send `sig` to a running container (SIGKILL: its whole process group); return its pid."""
    for node in _kubelet_nodes(state_dir):
        if node.running_pids()["containerd"] is None:
            continue
        pid = node.kill_container(namespace, pod, container, signal.Signals(sig).name)
        if pid is not None:
            return pid
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


def container_pids(state_dir: Path, namespace: str, pod: str, container: str,
                   node: str | None = None) -> list[int]:
    """Host pids of the first process of the running container (as recorded by node agents,
    or the task containerd runs on a kubelet node), on `node` only if given; empty when it
    runs nowhere."""
    pids = []
    pattern = f"nodes/{node or '*'}/pods/{namespace}_{pod}_*/containers/{container}.pid"
    for pid_file in sorted(state_dir.glob(pattern)):
        try:
            pids.append(int(pid_file.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    for real in _kubelet_nodes(state_dir):
        if node in (None, real.name) and real.running_pids()["containerd"] is not None:
            pid = real.task_pid(namespace, pod, container)
            pids += [pid] if pid is not None else []
    return pids


def lose_node(state_dir: Path, node: str) -> int:
    """Power loss: kill the node's agent and all its processes at once; return how many."""
    if (real := _kubelet_node(state_dir, node)) is not None:
        if real.running_pids()["kubelet"] is None:
            raise FaultError(f"node {node!r} is not running (already lost or stopped)")
        return kubelet.lose_kubelet_node(real)
    nodes.node_config(state_dir, node)  # an unknown node is named as such
    if nodes.running_agent_pid(state_dir, node) is None:
        raise FaultError(f"node {node!r} is not running (already lost or stopped)")
    return nodes.kill_node_processes(state_dir, node)


def node_running(state_dir: Path, node: str) -> bool:
    """Whether the node's kubelet (or node agent) runs: not once it is lost. The API server
    still shows a lost node Ready until the node controller's grace period ends."""
    if (real := _kubelet_node(state_dir, node)) is not None:
        return real.running_pids()["kubelet"] is not None
    return nodes.running_agent_pid(state_dir, node) is not None


def _kubelet_nodes(state_dir: Path) -> list[kubelet.KubeletNode]:
    from gemini_local.cluster import KUBELET_NODES  # cluster imports this module

    return kubelet.kubelet_nodes(state_dir / KUBELET_NODES)


def _kubelet_node(state_dir: Path, name: str) -> kubelet.KubeletNode | None:
    return next((n for n in _kubelet_nodes(state_dir) if n.name == name), None)


def _kubelet_table(node: kubelet.KubeletNode) -> str:
    return f"gemini_kubelet_{node.index}"


def _partition_kubelet_node(node: kubelet.KubeletNode) -> None:
    if os.geteuid() != 0:
        raise FaultError("network partitions need root")
    subnet = node.pod_subnet
    _replace_table(_kubelet_table(node), [
        # The kubelet reaches its own pods (probes) and nothing else; nobody reaches it.
        "type filter hook output priority -10; policy accept;",
        f"meta skgid {node.gid} ct direction original ip daddr != {{ {subnet}, {node.name} }} "
        "counter drop",
        f"ip daddr {node.name} meta skgid != {node.gid} counter drop",
        f"meta nfproto ipv6 meta skgid {node.gid} counter drop",
    ], "partition rules", {"forward": [
        # Pods talk among themselves on the node's bridge and to no other node's pods.
        "type filter hook forward priority -10; policy accept;",
        f"ip saddr {subnet} ip daddr != {subnet} counter drop",
        f"ip daddr {subnet} ip saddr != {subnet} counter drop",
    ]})


def _slow_kubelet_node(node: kubelet.KubeletNode, rate_bytes_per_s: int) -> None:
    """Police the traffic between the node's pods and other nodes' pods, each way (the host
    forwards it between the bridges); the kubelet's own traffic keeps its speed."""
    if os.geteuid() != 0:
        raise FaultError("slow links need root")
    police = (f"limit rate over {rate_bytes_per_s} bytes/second "
              f"burst {SLOW_LINK_BURST_BYTES} bytes counter drop")
    subnet = node.pod_subnet
    _replace_table(_kubelet_table(node) + "_slow", [], "slow-link rules", {
        "forward": ["type filter hook forward priority -5; policy accept;",
                    f"ip saddr {subnet} ip daddr != {subnet} goto up",
                    f"ip daddr {subnet} ip saddr != {subnet} goto down"],
        "up": [police], "down": [police]})


def _table(state_dir: Path, node: str) -> tuple[str, NodeNetwork, int | None]:
    config = nodes.node_config(state_dir, node)
    net = NodeNetwork.of_node_ip(config.node_ip, config.spec.index)
    return f"gemini_{net.octet}_{net.index}", net, config.gid


def _nft(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    if shutil.which("nft") is None:
        raise FaultError("network faults (partition, slow-link) need nftables: "
                         "apt-get install -y nftables")
    return subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True,
                          check=False)


def clear_octet_tables(octet: int) -> None:
    """Delete every nftables table of address range `octet` (partitions, slow links,
    connection tracking) that a cluster which died without `down` left behind."""
    if shutil.which("nft") is None:
        return
    listed = _nft(["list", "tables"]).stdout.split()
    for table in listed:
        if table.startswith(f"gemini_{octet}_"):
            _nft(["delete", "table", "inet", table])


def clear_kubelet_tables() -> None:
    """Delete the partitions of kubelet nodes (one set of them per machine)."""
    if shutil.which("nft") is None:
        return
    for table in _nft(["list", "tables"]).stdout.split():
        if table.startswith("gemini_kubelet_"):
            _nft(["delete", "table", "inet", table])


def _replace_table(table: str, rules: list[str], what: str,
                   chains: dict[str, list[str]] | None = None) -> None:
    """(Re)create `inet <table>` with an output chain of `rules` (and other `chains`)."""
    body = "".join(f"  chain {name} {{\n" + "".join(f"    {rule}\n" for rule in lines) + "  }\n"
                   for name, lines in {"output": rules, **(chains or {})}.items())
    _nft(["delete", "table", "inet", table])
    result = _nft(["-f", "-"], f"table inet {table} {{\n{body}}}\n")
    if result.returncode != 0:
        raise FaultError(f"nft refused the {what}: {result.stderr.strip()}")


def _track_table(state_dir: Path, node: str) -> str:
    return _table(state_dir, node)[0] + "_track"


def _slow_table(state_dir: Path, node: str) -> str:
    return _table(state_dir, node)[0] + "_slow"


def partition_node(state_dir: Path, node: str) -> None:
    """Cut the node off: its processes reach nothing outside its /24, nothing reaches them."""
    if (real := _kubelet_node(state_dir, node)) is not None:
        _partition_kubelet_node(real)
        return
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


def track_kubelet_connections() -> None:
    """`track_connections` for kubelet nodes (before they start; `clear_kubelet_tables` ends
    it). Without it a partition would miss the kubelet's heartbeats: they share one HTTP/2
    connection with a watch, and a connection picked up mid-stream on a watch event counts
    the API server as its opener."""
    if os.geteuid() == 0 and shutil.which("nft") is not None:
        _replace_table("gemini_kubelet_track", [
            "type filter hook output priority -20; policy accept;", "ct state new counter",
        ], "connection-tracking table")


def untrack_connections(state_dir: Path, node: str) -> None:
    if shutil.which("nft") is not None:
        _nft(["delete", "table", "inet", _track_table(state_dir, node)])


def parse_rate(text: str) -> int:
    """A link rate in bytes per second: bytes with a Kubernetes-like prefix ("500k", "10Mi",
    "2G", "1.5MB") or bits with "bit" ("100Mbit", "1Gbit"); an optional "/s" is allowed."""
    match = _RATE.match(text.strip())
    if not match:
        raise FaultError(f"not a rate: {text!r}; use bytes per second with an optional prefix "
                         "(500k, 10Mi, 2G) or bits with 'bit' (100Mbit, 1Gbit)")
    number, prefix, unit = float(match.group(1)), match.group(2), match.group(3)
    rate = int(number * _PREFIXES[prefix] / (8 if unit == "bit" else 1))
    if rate < 1:
        raise FaultError(f"rate {text!r} is below one byte per second")
    return rate


def slow_link_rules(cidr: str, gid: int, rate_bytes_per_s: int) -> dict[str, list[str]]:
    """The chains of a slow link: `output` sorts each packet crossing the node's edge into
    `up` (leaving the node) or `down` (reaching it); each polices its own direction.

    Connections the node's processes open are marked (ct mark = the node's group id) so that
    their replies count as the node's even when neither end is one of its addresses (a
    process that connects to 127.0.0.1 without binding its pod IP).
    """
    police = (f"limit rate over {rate_bytes_per_s} bytes/second "
              f"burst {SLOW_LINK_BURST_BYTES} bytes counter drop")
    return {
        "output": [
            # After a partition's table (-10): packets it drops use none of the rate.
            "type filter hook output priority -5; policy accept;",
            f"meta skgid {gid} ct direction original ct mark set {gid}",
            # Inside the node nothing is slowed: the node's own connections to its addresses,
            f"ct mark {gid} ct direction original ip daddr {cidr} accept",
            f"ct mark {gid} ct direction reply ip saddr {cidr} accept",
            f"ct mark {gid} ct direction original goto up",
            f"ct mark {gid} ct direction reply goto down",
            # and anything else between two of its addresses.
            f"ip saddr {cidr} ip daddr {cidr} accept",
            f"ip saddr {cidr} goto up",
            f"ip daddr {cidr} goto down",
        ],
        "up": [police],
        "down": [police],
    }


def slow_link(state_dir: Path, node: str, rate_bytes_per_s: int) -> None:
    """Police the node's traffic with the rest to `rate_bytes_per_s` each way (replacing an
    earlier rate); `heal_node` ends it. Packets over the rate are dropped, so TCP backs off
    to about the rate; after a quiet second a node may send one second's worth at once (the
    nftables bucket holds a second of the rate)."""
    if rate_bytes_per_s < 1:
        raise FaultError(f"a slow link needs a rate of at least 1 byte/s, not {rate_bytes_per_s}")
    if (real := _kubelet_node(state_dir, node)) is not None:
        _slow_kubelet_node(real, rate_bytes_per_s)
        return
    _, net, gid = _table(state_dir, node)
    if gid is None or os.geteuid() != 0:
        raise FaultError("slow links need root: the node's processes must run with their own "
                         "group id (start the cluster as root)")
    chains = slow_link_rules(net.cidr, gid, rate_bytes_per_s)
    _replace_table(_slow_table(state_dir, node), chains.pop("output"), "slow-link rules",
                   chains)


def heal_node(state_dir: Path, node: str, missing_ok: bool = True) -> bool:
    """Lift a partition and a slow link; True if the node had either."""
    real = _kubelet_node(state_dir, node)
    tables = ([_kubelet_table(real), _kubelet_table(real) + "_slow"] if real is not None
              else [_table(state_dir, node)[0], _slow_table(state_dir, node)])
    if shutil.which("nft") is None:
        if missing_ok:
            return False
        raise FaultError("nftables is not installed, so no node can be partitioned or slowed")
    deleted = [_nft(["delete", "table", "inet", t]).returncode == 0 for t in tables]
    if not any(deleted) and not missing_ok:
        raise FaultError(f"node {node!r} is neither partitioned nor slowed")
    return any(deleted)


def _has_table(table: str) -> bool:
    if shutil.which("nft") is None:
        return False
    return _nft(["list", "table", "inet", table]).returncode == 0


def is_partitioned(state_dir: Path, node: str) -> bool:
    real = _kubelet_node(state_dir, node)
    return _has_table(_kubelet_table(real) if real is not None else _table(state_dir, node)[0])


def is_slowed(state_dir: Path, node: str) -> bool:
    if (real := _kubelet_node(state_dir, node)) is not None:
        return _has_table(_kubelet_table(real) + "_slow")
    return _has_table(_slow_table(state_dir, node))


def add_node(kubeconfig: Path, pki: Pki, state_dir: Path, spec: nodes.NodeSpec,
             timeout: float = 30.0) -> int:
    """Start a fresh node (a spare) and wait until its Node is registered; return its pid."""
    pid = nodes.start_node_agent(kubeconfig, pki, state_dir, spec)
    nodes.wait_for_node_agents(state_dir, [spec.name], timeout)
    return pid
