"""Real kubelet nodes for the local cluster: kubelet, containerd, runc and a bridge CNI."""

from gemini_local.kubelet.host import mounts_under
from gemini_local.kubelet.node import (
    PAUSE_IMAGE,
    KubeletNode,
    KubeletNodeError,
    kubelet_nodes,
    lose_kubelet_node,
    reclaim_stale_nodes,
    start_kubelet_node,
    start_kubelet_nodes,
    stop_kubelet_node,
    stop_kubelet_nodes,
)

__all__ = ["PAUSE_IMAGE", "KubeletNode", "KubeletNodeError", "kubelet_nodes",
           "lose_kubelet_node", "mounts_under", "reclaim_stale_nodes", "start_kubelet_node",
           "start_kubelet_nodes", "stop_kubelet_node", "stop_kubelet_nodes"]
