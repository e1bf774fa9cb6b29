"""A small asyncio client for the Kubernetes REST API, as the node agent needs it.

aiohttp rather than the generated client: one event loop for the whole agent (cheap in CPU),
and the connections leave from the node's own IP, so cutting the node off the network also cuts
its heartbeats.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import yaml

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 5.0


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


@dataclass(frozen=True)
class ApiTarget:
    """Where the API server is and how to trust it, read from a kubeconfig."""

    server: str
    ca_file: Path

    @property
    def host(self) -> str:
        return urlparse(self.server).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return urlparse(self.server).port or 443

    @staticmethod
    def from_kubeconfig(path: Path, ca_out: Path) -> ApiTarget:
        """Server and CA of the current context; inline CA data is written to `ca_out`."""
        config = yaml.safe_load(path.read_text())
        context_name = config.get("current-context")
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        if "certificate-authority-data" in cluster:
            import base64

            ca_out.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
            return ApiTarget(cluster["server"], ca_out)
        ca = Path(cluster["certificate-authority"])
        return ApiTarget(cluster["server"], ca if ca.is_absolute() else path.parent / ca)


class KubeApi:
    """Authenticated JSON requests and watches against one API server."""

    def __init__(self, target: ApiTarget, cert: Path, key: Path, local_ip: str | None) -> None:
        self.target = target
        ctx = ssl.create_default_context(cafile=str(target.ca_file))
        ctx.load_cert_chain(str(cert), str(key))
        local_addr = (local_ip, 0) if local_ip else None
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx, local_addr=local_addr, limit=32),
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self, method: str, path: str, body: Obj | None = None,
        params: Mapping[str, str] | None = None, content_type: str = "application/json",
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> Obj:
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        async with self._session.request(
            method, self.target.server + path, data=data, params=params, headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise ApiError(resp.status, text)
            result: Obj = json.loads(text) if text else {}
            return result

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> Obj:
        return await self.request("GET", path, params=params)

    async def get_or_none(self, path: str) -> Obj | None:
        try:
            return await self.get(path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def merge_patch(self, path: str, body: Obj) -> Obj:
        return await self.request("PATCH", path, body, content_type=MERGE_PATCH)

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        """Events of one watch request; ends when the server closes it (caller re-watches)."""
        query = {**params, "watch": "1", "allowWatchBookmarks": "true"}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=90)
        async with self._session.get(
            self.target.server + path, params=query, timeout=timeout,
        ) as resp:
            if resp.status >= 300:
                raise ApiError(resp.status, await resp.text())
            while True:
                line = await resp.content.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)


async def retry_forever(what: str, coro_factory: Any, delay: float = 1.0) -> Any:
    """Await `coro_factory()` until it succeeds (the API server may be briefly unreachable)."""
    while True:
        try:
            return await coro_factory()
        except (TimeoutError, ApiError, aiohttp.ClientError, OSError) as err:
            print(f"{what} failed, retrying in {delay:.0f}s: {err}", flush=True)
            await asyncio.sleep(delay)
