"""Which connection may write a rank's replica: the one coming from that rank's address.

Every pod of a job holds the job token, so the token alone lets any of them write any rank's
replica. A holder therefore also checks where a `PUT_BEGIN` comes from: rank R's shard is
accepted only from rank R's own address, as this sidecar's placement names it (the pod IP
the operator delivered, or a name resolved to it). Senders connect from their own address
(`peer_client.connect(source=...)`), which a pod cannot choose for another pod: in a pod
network the source IP is the pod's. Owners are the only writers: a replacement pulls the
replicas it holds for others (GET), it is never pushed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import time
from collections.abc import Callable, Mapping

from gemini.control.signing import plain_ip
from gemini_sidecar.config import PeerAddress

RESOLVED_FOR_S = 30.0  # a name's addresses are looked up again after this (pods come and go)
KNOWN_REFRESH_S = 5.0


class SenderCheck:
    """Whether a connection from `source` may write rank R's replica (see the module)."""

    def __init__(self, peer_of: Callable[[int], PeerAddress | None]) -> None:
        self._peer_of = peer_of
        self._resolved: dict[str, tuple[float, frozenset[str]]] = {}

    async def problem(self, rank: int, source: str) -> str | None:
        """None if `source` is rank `rank`'s address, else why the write is refused."""
        addr = self._peer_of(rank)
        if addr is None:
            return f"no address is known here for rank {rank}, so no sender of it is accepted"
        source = plain_ip(source)
        ips = await self.addresses(addr.host, fresh=False)
        if source not in ips:  # the name may point at a new pod since it was looked up
            ips = await self.addresses(addr.host, fresh=True)
        if source in ips:
            return None
        return (f"rank {rank}'s shard may only come from rank {rank} at {addr.host} "
                f"({', '.join(sorted(ips)) or 'unresolved'}), not from {source}")

    async def addresses(self, host: str, fresh: bool) -> frozenset[str]:
        host = plain_ip(host)
        try:
            return frozenset({str(ipaddress.ip_address(host))})
        except ValueError:
            pass  # a name
        cached = self._resolved.get(host)
        now = time.monotonic()
        if cached is not None and not fresh and now - cached[0] < RESOLVED_FOR_S:
            return cached[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                                 type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        ips = frozenset(plain_ip(str(info[4][0])) for info in infos)
        self._resolved[host] = (now, ips)
        return ips


class KnownPeers:
    """The addresses of the placement's peers, looked up every KNOWN_REFRESH_S on the event
    loop, so a listener can ask at once, without a lookup, whether a connection comes from
    the job's own pods (`has`)."""

    def __init__(self, peers: Callable[[], Mapping[int, PeerAddress]],
                 check: SenderCheck) -> None:
        self._peers, self._check = peers, check
        self._ips: frozenset[str] = frozenset()
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """The placement changed: look its addresses up now."""
        self._changed.set()

    def has(self, host: str) -> bool:
        return plain_ip(host) in self._ips

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def refresh(self) -> None:
        ips: set[str] = set()
        for host in {a.host for a in self._peers().values()}:
            ips |= await self._check.addresses(host, fresh=False)
        self._ips = frozenset(ips)

    async def _refresh_forever(self) -> None:
        while True:
            self._changed.clear()
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), KNOWN_REFRESH_S)
