"""Test builders for GeminiJobs: `make_job("x").with_nodes(4).set("suspend", True).obj()`."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from gemini.control.inventory import Inventory, LocalCopy, MemoryUse, ReplicaCopy, Sending
from gemini.control.messages import Peers
from gemini_operator.core import naming


class JobBuilder:
    def __init__(self, name: str, namespace: str = "default") -> None:
        self._obj: dict[str, Any] = {
            "apiVersion": naming.API_VERSION,
            "kind": naming.KIND,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "numNodes": 4,
                "template": {"image": "python:3.11", "command": ["python", "train.py"]},
            },
        }

    def with_nodes(self, count: int) -> JobBuilder:
        return self.set("numNodes", count)

    def with_replicas(self, count: int) -> JobBuilder:
        return self.set("checkpoint.replicas", count)

    def with_uid(self, uid: str) -> JobBuilder:
        self._obj["metadata"]["uid"] = uid
        return self

    def set(self, path: str, value: Any) -> JobBuilder:
        """Set `spec.<path>` (dotted; `metadata.` paths address the metadata instead)."""
        keys = path.split(".")
        node = self._obj if keys[0] == "metadata" else self._obj["spec"]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
        return self

    def drop(self, path: str) -> JobBuilder:
        keys = path.split(".")
        node = self._obj["spec"]
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)

    def spec(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj["spec"])


def make_job(name: str = "train", namespace: str = "default") -> JobBuilder:
    return JobBuilder(name, namespace)


def inventory(rank: int, local: Iterable[tuple[int, bool]] = (),
              replicas: Iterable[tuple[int, int, bool]] = (), checksum: int = 0,
              placement: Peers | None = None) -> Inventory:
    """A sidecar's GET /inventory: its own (version, complete) slots and the (shard rank,
    version, complete) replicas it holds; the rest as an idle sidecar sends it."""
    return Inventory(
        job="train", rank=rank, world_size=4,
        local=tuple(LocalCopy(rank, v, c, 0, checksum) for v, c in local),
        replicas=tuple(ReplicaCopy(r, v, c, 0, 0, checksum) for r, v, c in replicas),
        sending=Sending("interleaved", -1, 0, True, None, ""), memory=MemoryUse(0, 0),
        placement=placement or Peers({}, (), ()))
