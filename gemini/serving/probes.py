"""A listener for the kubelet's probes only, which a flood cannot starve: no total limit (a
few addresses cannot fill it), a few connections per address, and each connection gets its
whole request within PROBE_DEADLINE_S and its answer, then is closed, so holding connections
costs a flood a new one every couple of seconds. It answers GET for its paths (200 or 503 and
a small JSON body) and nothing else."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from gemini.serving.gate import (
    UNCOUNTED,
    ConnectionGate,
    ConnectionLimits,
    RefusalLog,
    address_of,
    host_of,
)
from gemini.serving.http import LISTEN_BACKLOG

log = logging.getLogger(__name__)
PROBE_DEADLINE_S = 2.0  # the kubelet sends its request at once
MAX_REQUEST_BYTES = 8192
PROBES_PER_HOST = 8  # the kubelet runs at most three probes of one container at a time
# no total: a few addresses must not be able to fill it
PROBE_LIMITS = ConnectionLimits(sys.maxsize, PROBES_PER_HOST)

# path -> () -> (healthy, JSON body)
Check = Callable[[], tuple[bool, Mapping[str, Any]]]



class ProbeListener:
    def __init__(self, checks: Mapping[str, Check], name: str = "probes",
                 refused: Any = None, deadline_s: float = PROBE_DEADLINE_S) -> None:
        self._checks = dict(checks)
        self._deadline = deadline_s
        self.gate = ConnectionGate(PROBE_LIMITS)
        self.refusals = RefusalLog(name, refused or UNCOUNTED)
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._serve, host, port, reuse_address=True,
                                                 backlog=LISTEN_BACKLOG, limit=MAX_REQUEST_BYTES)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        self.refusals.flush()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = address_of(writer.get_extra_info("peername"))
        refusal = self.gate.admit(host_of(peer))
        if refusal is not None:
            self.refusals.refuse(peer, refusal)
            writer.transport.abort()
            return
        try:
            async with asyncio.timeout(self._deadline):
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(self._answer(head))
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError) as err:
            self.refusals.refuse(peer, f"no complete probe request: {type(err).__name__}")
        finally:
            self.gate.release(host_of(peer))
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        check = self._checks.get(path)
        if method != "GET" or check is None:
            return _response(404, {"error": f"only GET {', '.join(sorted(self._checks))}"})
        ok, body = check()
        return _response(200 if ok else 503, body)


def _response(status: int, body: Mapping[str, Any]) -> bytes:
    data = json.dumps(dict(body)).encode()
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data
