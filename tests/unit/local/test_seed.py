"""The image seed's copy: containerd's content and layers shared by hard links, its databases
private to each node (a node's containerd writing its metadata must not touch another's)."""

from __future__ import annotations

import os
from pathlib import Path

from gemini_local.kubelet import seed


def _tree(root: Path) -> None:
    files = {
        "io.containerd.content.v1.content/blobs/sha256/ab": b"layer",
        "io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs/usr/lib/torch.so": b"so",
        "io.containerd.snapshotter.v1.overlayfs/metadata.db": b"snapshots db",
        "io.containerd.metadata.v1.bolt/meta.db": b"images db",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def test_a_clone_links_content_and_layers_and_copies_the_databases(tmp_path: Path) -> None:
    store = tmp_path / "seed" / "root"
    _tree(store)
    node = tmp_path / "node"
    node.mkdir()
    seed.clone(store, node / "root")
    for linked in ("io.containerd.content.v1.content/blobs/sha256/ab",
                   "io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs/usr/lib/torch.so"):
        assert os.path.samefile(store / linked, node / "root" / linked), linked
    for private in ("io.containerd.snapshotter.v1.overlayfs/metadata.db",
                    "io.containerd.metadata.v1.bolt/meta.db"):
        assert not os.path.samefile(store / private, node / "root" / private), private
        (node / "root" / private).write_bytes(b"changed by the node")
        assert (store / private).read_bytes() != b"changed by the node"


def test_the_databases_are_the_files_outside_the_linked_trees(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in seed._private_files(tmp_path)) == [
        "io.containerd.metadata.v1.bolt/meta.db",
        "io.containerd.snapshotter.v1.overlayfs/metadata.db"]
