"""The Node object and its Lease: registration, Ready heartbeats and lease renewals."""

from __future__ import annotations

import asyncio
import datetime as dt
import platform
import uuid
from collections.abc import Callable
from typing import Any

from gemini_local.nodeagent.config import KUBELET_PORT, AgentConfig
from gemini_local.nodeagent.kubeapi import ApiError, KubeApi, retry_forever

LEASE_RENEW_S = 2.0
LEASE_DURATION_S = 40
STATUS_REPORT_S = 10.0
AGENT_VERSION = "v1.35.4-gemini-local"
Obj = dict[str, Any]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeReporter:
    """Creates the Node, keeps its status and Lease fresh."""

    def __init__(self, api: KubeApi, config: AgentConfig,
                 on_reconnect: Callable[[], None] = lambda: None) -> None:
        self.api = api
        self.on_reconnect = on_reconnect
        self.config = config
        self.spec = config.spec
        self.uid = ""
        self._ready_since = _now()
        self._boot_id = str(uuid.uuid4())

    async def register(self) -> None:
        await retry_forever("registering the node", self._register)
        await retry_forever("reporting node status", self.report_status)

    async def _register(self) -> None:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.spec.name, "labels": self.spec.labels(),
                             "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
                "spec": {}}
        try:
            node = await self.api.request("POST", "/api/v1/nodes", body)
        except ApiError as err:
            if err.status != 409:
                raise
            node = await self.api.merge_patch(f"/api/v1/nodes/{self.spec.name}",
                                              {"metadata": {"labels": self.spec.labels()}})
        self.uid = node["metadata"]["uid"]

    def status(self) -> Obj:
        now = _now()

        def cond(kind: str, status: str, reason: str, message: str, since: str) -> Obj:
            return {"type": kind, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": since}

        capacity = self.spec.capacity()
        return {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory",
                     "node agent has sufficient memory available", self._ready_since),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure",
                     "node agent has no disk pressure", self._ready_since),
                cond("PIDPressure", "False", "KubeletHasSufficientPID",
                     "node agent has sufficient PID available", self._ready_since),
                cond("Ready", "True", "KubeletReady", "gemini node agent is posting ready status",
                     self._ready_since),
            ],
            "addresses": [{"type": "InternalIP", "address": self.config.node_ip},
                          {"type": "Hostname", "address": self.spec.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": KUBELET_PORT}},
            "nodeInfo": {
                "machineID": self.uid.replace("-", ""), "systemUUID": self.uid,
                "bootID": self._boot_id, "kernelVersion": platform.release(),
                "osImage": "gemini local node (processes)", "operatingSystem": "linux",
                "architecture": "amd64", "containerRuntimeVersion": "gemini-process://0.1.0",
                "kubeletVersion": AGENT_VERSION, "kubeProxyVersion": "",
            },
        }

    async def report_status(self) -> None:
        await self.api.merge_patch(f"/api/v1/nodes/{self.spec.name}/status",
                                   {"status": self.status()})

    async def status_loop(self) -> None:
        while True:
            await asyncio.sleep(STATUS_REPORT_S)
            await self._quietly("node status", self.report_status())

    async def lease_loop(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.spec.name}"
        healthy = True
        while True:
            ok = await self._quietly("lease", self._renew(path))
            if ok and not healthy:  # back after a partition: say Ready now, not in 10 s
                self.on_reconnect()
                await self._quietly("node status", self.report_status())
            healthy = ok
            await asyncio.sleep(LEASE_RENEW_S)

    async def _renew(self, path: str) -> None:
        try:
            await self.api.merge_patch(path, {"spec": {"holderIdentity": self.spec.name,
                                                       "renewTime": _micro_now()}})
        except ApiError as err:
            if err.status != 404:
                raise
            await self.api.request("POST", path.rsplit("/", 1)[0], self._lease())

    def _lease(self) -> Obj:
        return {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": self.spec.name, "namespace": "kube-node-lease",
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                              "name": self.spec.name, "uid": self.uid}]},
            "spec": {"holderIdentity": self.spec.name, "leaseDurationSeconds": LEASE_DURATION_S,
                     "renewTime": _micro_now()},
        }

    @staticmethod
    async def _quietly(what: str, coro: Any) -> bool:
        """Heartbeats keep going through API errors and partitions; log and try again later."""
        try:
            await coro
            return True
        except Exception as err:  # the heartbeat must outlive any single failure
            print(f"{what} update failed: {err!r}", flush=True)
            return False
