"""`gemini local down` removes the /tmp folders of pods whose node agent was killed (a node
loss fault): the agent removes a pod's folder only when it tears the pod down itself."""

from __future__ import annotations

import tempfile

from gemini_local.nodeagent.pod import pod_tmp_dir
from gemini_local.nodes import remove_pod_tmp_dirs

UID = "0892929d-a88f-4f0e-9b1a-123456789abc"
OTHER = "11111111-2222-3333-4444-555555555555"


def test_the_pods_of_a_node_lose_their_tmp_folders_and_others_keep_theirs(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    node = tmp_path / "nodes" / "node-0"
    (node / "pods" / f"ns_job-worker-0_{UID}").mkdir(parents=True)
    mine, other = pod_tmp_dir(UID), pod_tmp_dir(OTHER)
    for folder in (mine, other):
        (folder / "trainer").mkdir(parents=True)
        (folder / "trainer" / "left").write_text("x")
    remove_pod_tmp_dirs(node)
    assert not mine.exists()
    assert other.exists()  # another node's pod
    remove_pod_tmp_dirs(tmp_path / "nodes" / "node-without-pods")  # nothing there: no error
