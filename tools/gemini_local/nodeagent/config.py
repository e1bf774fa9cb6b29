"""What one node agent is started with: the node's shape, identity and where things live."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

KUBELET_PORT = 10250
RACK_LABEL = "topology.gemini.io/rack"
ZONE_LABEL = "topology.kubernetes.io/zone"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeSpec:
    """The shape of one local node; `index` picks its address range (unique per cluster)."""

    name: str
    zone: str
    rack: str
    index: int
    cpu: str = "8"
    memory: str = "32Gi"
    pods: int = 110
    gpus: int = 1

    def capacity(self) -> dict[str, str]:
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods),
               "ephemeral-storage": "100Gi"}
        if self.gpus:
            cap[GPU_RESOURCE] = str(self.gpus)
        return cap

    def labels(self) -> dict[str, str]:
        return {
            "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64", ZONE_LABEL: self.zone, RACK_LABEL: self.rack,
            "node.gemini.io/local": "true",
        }


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent process needs, written as JSON next to its logs."""

    spec: NodeSpec
    state_dir: str
    node_dir: str
    kubeconfig: str
    client_cert: str
    client_key: str
    serving_cert: str
    serving_key: str
    ca_cert: str
    node_ip: str
    cidr: str
    gid: int | None
    venv_bin: str
    shm_dir: str

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def load(path: Path) -> AgentConfig:
        raw = json.loads(path.read_text())
        return AgentConfig(**{**raw, "spec": NodeSpec(**raw["spec"])})
