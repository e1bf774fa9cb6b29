"""The local node agent: a process that plays kubelet for one Node, running pods as processes.

Started (one per node) by `gemini_local.nodes.start_node_agent`; see docs/local-cluster.md.
"""
