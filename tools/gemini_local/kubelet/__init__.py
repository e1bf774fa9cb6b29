"""Real kubelet nodes for the local cluster: kubelet, containerd, runc and a bridge CNI."""

from gemini_local.kubelet.host import mounts_under
from gemini_local.kubelet.node import (
    PAUSE_IMAGE,
    KubeletNode,
    KubeletNodeError,
    start_kubelet_node,
    stop_kubelet_node,
)

__all__ = ["PAUSE_IMAGE", "KubeletNode", "KubeletNodeError", "mounts_under",
           "start_kubelet_node", "stop_kubelet_node"]
