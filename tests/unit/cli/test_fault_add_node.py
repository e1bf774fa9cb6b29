"""`gemini fault add-node` asks for a name where the cluster's nodes take one (node agents)
and refuses one where they are named by their address (kubelet nodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemini_cli import main


def _cluster(state_dir: Path, kind: str) -> Path:
    state_dir.mkdir()
    ports = dict.fromkeys(("etcd_client", "etcd_peer", "apiserver", "controller_manager",
                           "scheduler"), 1)
    (state_dir / "controlplane.json").write_text(json.dumps({"ports": ports}))
    (state_dir / "cluster.json").write_text(json.dumps({"nodeKind": kind}))
    return state_dir


def test_a_node_agent_needs_a_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _cluster(tmp_path / "agents", "node-agent")
    code = main(["fault", "--state-dir", str(state), "add-node", "--zone", "z", "--rack", "r"])
    assert code == 1
    assert "name the new node: gemini fault add-node NAME" in capsys.readouterr().err


def test_a_kubelet_node_is_named_by_its_address(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    state = _cluster(tmp_path / "kubelets", "kubelet")
    code = main(["fault", "--state-dir", str(state), "add-node", "spare-1", "--zone", "z",
                 "--rack", "r"])
    assert code == 1
    assert "kubelet nodes are named by their address: leave out 'spare-1'" in \
        capsys.readouterr().err


def test_no_cluster_says_how_to_start_one(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fault", "--state-dir", str(tmp_path), "add-node", "--zone", "z", "--rack",
                 "r"])
    assert code == 1 and "run `gemini local up` first" in capsys.readouterr().err


def test_a_spare_needs_the_images_the_cluster_started_with(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _cluster(tmp_path / "kubelets", "kubelet")
    gone = tmp_path / "cache" / "0123456789abcdef" / "examples.tar"
    (state / "cluster.json").write_text(json.dumps(
        {"nodeKind": "kubelet", "images": {"examples": "gemini-examples:0.1.0"},
         "imageArchives": {"examples": str(gone)}}))
    code = main(["fault", "--state-dir", str(state), "add-node", "--zone", "z", "--rack", "r"])
    assert code == 1
    assert f"the images this cluster started with are gone from the cache ({gone})" in \
        capsys.readouterr().err
