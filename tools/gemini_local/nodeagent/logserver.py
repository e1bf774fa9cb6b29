"""The agent's HTTPS endpoint on the node's IP, serving container logs as a kubelet does.

The API server proxies `kubectl logs` to https://<InternalIP>:10250/containerLogs/<ns>/<pod>/
<container>; it authenticates with its kubelet client certificate, which must be signed by the
cluster CA. Supported query parameters: previous, tailLines, limitBytes, follow.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from gemini_local.nodeagent.container import ContainerRun

FindContainer = Callable[[str, str, str], ContainerRun | None]
_FOLLOW_POLL_S = 0.2


def log_file(run: ContainerRun, previous: bool) -> Path | None:
    """The log of the current run, or of the one before it when `previous`."""
    index = run.runs - (2 if previous else 1)
    return run.log_path(index) if index >= 0 else None


def tail(data: bytes, lines: int) -> bytes:
    if lines < 0:
        return data
    if lines == 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def make_app(find: FindContainer) -> web.Application:
    async def container_logs(request: web.Request) -> web.StreamResponse:
        ns, pod, name = (request.match_info[k] for k in ("namespace", "pod", "container"))
        run = find(ns, pod, name)
        if run is None:
            raise web.HTTPNotFound(text=f"container {name!r} of pod {ns}/{pod} is not on this node")
        previous = request.query.get("previous", "false").lower() == "true"
        path = log_file(run, previous)
        if path is None or not path.exists():
            which = "previous terminated" if previous else "current"
            raise web.HTTPBadRequest(text=f"{which} container {name!r} of pod {pod!r} not found")
        data = tail(path.read_bytes(), int(request.query.get("tailLines", "-1")))
        if "limitBytes" in request.query:
            data = data[: int(request.query["limitBytes"])]
        follow = request.query.get("follow", "false").lower() == "true"
        if not follow or previous:
            return web.Response(body=data, content_type="text/plain")
        return await _follow(request, run, path, data)

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", container_logs)
    app.router.add_get("/healthz", healthz)
    return app


async def _follow(request: web.Request, run: ContainerRun, path: Path,
                  first: bytes) -> web.StreamResponse:
    """Stream the log as it grows until this run of the container ends."""
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    await resp.write(first)
    offset = path.stat().st_size
    process = run.process
    while True:
        size = path.stat().st_size if path.exists() else offset
        if size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                await resp.write(f.read(size - offset))
            offset = size
        elif process is None or process.returncode is not None:
            break
        await asyncio.sleep(_FOLLOW_POLL_S)
    await resp.write_eof()
    return resp


def server_ssl(cert: Path, key: Path, client_ca: Path) -> ssl.SSLContext:
    """Serve with the node's certificate; accept only clients signed by the cluster CA."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
    ctx.load_cert_chain(str(cert), str(key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def start(find: FindContainer, host: str, port: int, ctx: ssl.SSLContext) -> web.AppRunner:
    runner = web.AppRunner(make_app(find), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ctx).start()
    return runner
