"""`gemini local up` says how to reach what it started: S3's keys, Kueue's queue."""

from __future__ import annotations

from gemini_cli.local import _render_up


def test_the_summary_names_the_kueue_queue_and_its_quota() -> None:
    info = {"startupSeconds": 11.9, "topology": {"nodes": 2}, "apiServer": "https://x",
            "kubeconfig": "/k", "s3": None,
            "kueue": {"localQueue": "default/local",
                      "quota": {"cpu": "16", "memory": str(64 * 2**30)}}}
    text = _render_up(info)
    assert "Kueue:       LocalQueue default/local, quota 16 CPUs, 64 GiB of memory" in text
    assert "Kueue" not in _render_up({**info, "kueue": None})


def test_the_summary_says_the_nodes_are_kubelets_and_names_the_imported_images() -> None:
    info = {"startupSeconds": 22.7, "topology": {"nodes": 3}, "apiServer": "https://x",
            "kubeconfig": "/k", "s3": None, "kueue": None, "nodeKind": "kubelet",
            "images": {"operator": "gemini-operator:0.1.0", "sidecar": "gemini-sidecar:0.1.0"}}
    text = _render_up(info)
    assert "3 kubelet nodes" in text
    assert "images:      gemini-operator:0.1.0, gemini-sidecar:0.1.0" in text
    plain = _render_up({**info, "nodeKind": "node-agent", "images": {}})
    assert "3 nodes" in plain and "images" not in plain
