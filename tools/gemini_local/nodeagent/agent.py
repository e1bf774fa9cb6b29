"""The node agent's main loop: register the node, watch the pods bound to it, run them."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import aiohttp

from gemini_local.nodeagent import logserver, procs
from gemini_local.nodeagent.addressing import PodIpPool
from gemini_local.nodeagent.config import KUBELET_PORT, AgentConfig
from gemini_local.nodeagent.container import ContainerRun
from gemini_local.nodeagent.kubeapi import ApiTarget, KubeApi
from gemini_local.nodeagent.node import NodeReporter
from gemini_local.nodeagent.pod import NodeContext, PodWorker
from gemini_local.nodeagent.volumes import mount_namespaces_available

Obj = dict[str, Any]
READY_MARKER = "registered"
_WATCH_TIMEOUT_S = "55"


class NodeAgent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.node_dir = Path(config.node_dir)
        target = ApiTarget.from_kubeconfig(Path(config.kubeconfig), self.node_dir / "api-ca.crt")
        self.api = KubeApi(target, Path(config.client_cert), Path(config.client_key),
                           config.node_ip)
        ips = [f"{config.cidr.rsplit('.', 1)[0]}.{host}" for host in range(2, 255)]
        self.pool = PodIpPool(ips)
        self.workers: dict[str, PodWorker] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self.reporter = NodeReporter(self.api, config, self._restart_watch)
        self._watch_task: asyncio.Task[None] | None = None

    def _find(self, namespace: str, pod: str, container: str) -> ContainerRun | None:
        for worker in self.workers.values():
            if (worker.namespace, worker.name) == (namespace, pod):
                return next((r for r in worker.containers() if r.name == container), None)
        return None

    async def run(self) -> None:
        http = aiohttp.ClientSession()  # probes: plain connections from the node
        ctx = NodeContext(self.api, self.config, http, mount_namespaces_available(),
                          self.pool.allocate, self.pool.release)
        ssl_ctx = logserver.server_ssl(Path(self.config.serving_cert),
                                       Path(self.config.serving_key), Path(self.config.ca_cert))
        runner = await logserver.start(self._find, self.config.node_ip, KUBELET_PORT, ssl_ctx)
        await self.reporter.register()
        (self.node_dir / READY_MARKER).write_text(self.reporter.uid)
        print(f"node {self.config.spec.name} registered at {self.config.node_ip}", flush=True)
        try:
            await asyncio.gather(self.reporter.lease_loop(), self.reporter.status_loop(),
                                 self._watch_pods(ctx))
        finally:
            await runner.cleanup()
            await http.close()
            await self.api.close()

    def _restart_watch(self) -> None:
        """After a partition the watch connection may be stuck for long: list and watch anew."""
        if self._watch_task is not None:
            self._watch_task.cancel()

    async def _watch_pods(self, ctx: NodeContext) -> None:
        while True:
            self._watch_task = asyncio.create_task(self._list_and_watch(ctx))
            try:
                await self._watch_task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    self._watch_task.cancel()
                    raise
            except Exception as err:  # whatever went wrong, list and watch again
                print(f"pod watch failed, re-listing: {err!r}", flush=True)
                await asyncio.sleep(1)

    async def _list_and_watch(self, ctx: NodeContext) -> None:
        params = {"fieldSelector": f"spec.nodeName={self.config.spec.name}"}
        listing = await self.api.get("/api/v1/pods", params)
        self._sync(ctx, listing["items"])
        await self._watch_from(ctx, params, listing["metadata"]["resourceVersion"])

    async def _watch_from(self, ctx: NodeContext, params: dict[str, str], version: str) -> None:
        """Follow the watch from `version`; return when a re-list is needed (410 Gone)."""
        while True:
            query = {**params, "resourceVersion": version, "timeoutSeconds": _WATCH_TIMEOUT_S}
            async for event in self.api.watch("/api/v1/pods", query):
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    return
                version = obj["metadata"]["resourceVersion"]
                if kind == "DELETED":
                    worker = self.workers.get(obj["metadata"]["uid"])
                    if worker is not None:
                        worker.removed()
                elif kind in ("ADDED", "MODIFIED"):
                    self._handle(ctx, obj)

    def _sync(self, ctx: NodeContext, pods: list[Obj]) -> None:
        seen = {p["metadata"]["uid"] for p in pods}
        for uid, worker in list(self.workers.items()):
            if uid not in seen:
                worker.removed()
        for pod in pods:
            self._handle(ctx, pod)

    def _handle(self, ctx: NodeContext, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            if pod["metadata"].get("deletionTimestamp"):  # finished before this agent started
                worker = PodWorker(ctx, pod)
                worker.finished = True
                self._cleanups.add(task := asyncio.create_task(worker._delete()))
                task.add_done_callback(self._cleanups.discard)
            return
        worker = PodWorker(ctx, pod)
        worker.update(pod)
        self.workers[uid] = worker
        task = asyncio.create_task(worker.run())
        task.add_done_callback(lambda _t: self.workers.pop(uid, None))


def kill_all_containers(node_dir: Path) -> None:
    for pgid in procs.recorded_groups(node_dir):
        procs.kill_group(pgid)
        procs.forget_group(node_dir, pgid)


async def _run(config: AgentConfig) -> None:
    await NodeAgent(config).run()  # built inside the loop: aiohttp needs a running loop


def main(config_path: Path) -> int:
    config = AgentConfig.load(config_path)
    node_dir = Path(config.node_dir)
    loop = asyncio.new_event_loop()
    task = loop.create_task(_run(config))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    finally:
        # Stopping the agent stops its pods' processes; the pods stay bound (like a kubelet
        # restart), and a new agent for this node runs them again.
        kill_all_containers(node_dir)
        with contextlib.suppress(Exception):
            loop.close()
    return 0
