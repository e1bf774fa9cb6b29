"""Where a node lives on loopback: its IP, its pods' IPs and the group id its processes run as.

All of 127.0.0.0/8 is routed to `lo` on Linux, so every address below is reachable without
configuring anything. A cluster (one state directory) claims one second octet, each node one
/24 inside it: node `index` of cluster `c` is 127.c.(index+1).1 and its pods take
127.c.(index+1).2-254. Every process of a node (agent and containers) runs with one group id,
which lets nftables tell the node's packets apart and lets a power loss find every process.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Second octets used by clusters; 127.0.x.x stays free for the control plane and the user.
CLUSTER_OCTETS = range(100, 200)
_MAX_NODES = 254
# Group ids for node processes start here, far above distribution-assigned groups.
_GID_BASE = 200_000


def cluster_octet(state_dir: Path) -> int:
    """The preferred second octet for the cluster in `state_dir` (a hash of the path); the
    octet actually used is claimed machine-wide by gemini_local.nodes.network_octet."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).digest()
    return CLUSTER_OCTETS[int.from_bytes(digest[:4], "big") % len(CLUSTER_OCTETS)]


@dataclass(frozen=True)
class NodeNetwork:
    """The addresses and group id of one node."""

    octet: int
    index: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < _MAX_NODES:
            raise ValueError(f"node index {self.index} out of range: use 0..{_MAX_NODES - 1}")

    @staticmethod
    def of_node_ip(node_ip: str, index: int) -> NodeNetwork:
        return NodeNetwork(int(node_ip.split(".")[1]), index)

    @property
    def cidr(self) -> str:
        return f"127.{self.octet}.{self.index + 1}.0/24"

    @property
    def node_ip(self) -> str:
        return f"127.{self.octet}.{self.index + 1}.1"

    @property
    def gid(self) -> int:
        return _GID_BASE + self.octet * 256 + self.index + 1

    def pod_ips(self) -> list[str]:
        return [f"127.{self.octet}.{self.index + 1}.{host}" for host in range(2, 255)]

    def contains(self, ip: str) -> bool:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(self.cidr)


class PodIpPool:
    """Hands out a node's pod IPs, reusing a released one only after all others were used."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self._free = list(addresses)
        self._used: set[str] = set()

    def allocate(self) -> str:
        if not self._free:
            raise RuntimeError(f"no free pod IP left ({len(self._used)} in use)")
        ip = self._free.pop(0)
        self._used.add(ip)
        return ip

    def release(self, ip: str) -> None:
        if ip in self._used:
            self._used.remove(ip)
            self._free.append(ip)
