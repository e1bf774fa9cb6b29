"""The image cache key: every file the Dockerfile copies, and nothing else."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

from gemini_local import images


def _tree(root: Path) -> None:
    for name in ("Dockerfile", ".dockerignore", "requirements.lock", "pyproject.toml",
                 "README.md", "gemini/domain/x.py", "operator/gemini_operator/x.py",
                 "tests/test_x.py",
                 "tools/gemini_local/y.py", "examples/train_fsdp.py", "examples/notes.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def test_the_key_follows_what_the_dockerfile_copies_and_nothing_else(tmp_path: Path) -> None:
    _tree(tmp_path)
    key = images.source_key(tmp_path)
    for outside in ("tests/test_x.py", "tools/gemini_local/y.py", "examples/notes.md",
                    "operator/gemini_operator/__pycache__/x.cpython-311.pyc"):
        (tmp_path / outside).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / outside).write_text("changed")
    assert images.source_key(tmp_path) == key
    for inside in ("operator/gemini_operator/x.py", "requirements.lock",
                   "examples/train_fsdp.py", "cli/gemini_cli/new.py"):
        (tmp_path / inside).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / inside).write_text("changed")
        assert images.source_key(tmp_path) != key, inside
        key = images.source_key(tmp_path)


def test_readme_edits_keep_the_key_and_source_edits_change_it(tmp_path: Path) -> None:
    """The images get a stand-in README (pyproject's `readme` needs one at install): editing the
    real one must not rebuild them."""
    _tree(tmp_path)
    key = images.source_key(tmp_path)
    (tmp_path / "README.md").write_text("a new paragraph")
    assert images.source_key(tmp_path) == key
    (tmp_path / "gemini/domain/x.py").write_text("changed")
    assert images.source_key(tmp_path) != key


def test_images_are_named_as_the_chart_names_them() -> None:
    chart = (images.CHART.parent / "values.yaml").read_text()
    assert "repository: gemini-operator" in chart and "repository: gemini-sidecar" in chart
    assert images.image_name("operator") == f"gemini-operator:{images.version()}"
    assert images.full_name("sidecar") == f"docker.io/library/gemini-sidecar:{images.version()}"


def test_a_build_waits_for_another_of_its_source_and_clears_what_a_killed_one_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(images, "source_key", lambda: "key")
    monkeypatch.setattr(images.os, "geteuid", lambda: 0)
    folder = tmp_path / "key"
    (folder / ".build-killed").mkdir(parents=True)
    (folder / ".build-killed" / "trainer.tar").write_bytes(b"partial")
    built: list[list[str]] = []

    def build(targets: list[str], into: Path) -> None:
        built.append(targets)
        for target in targets:
            (into / f"{target}.tar").write_bytes(b"image")

    monkeypatch.setattr(images, "_build", build)
    other = threading.Thread(target=images.archives, args=(["operator"],))
    with images._building(folder):  # a build of the same source under way
        assert not (folder / ".build-killed").exists()
        other.start()
        other.join(0.3)
        assert other.is_alive() and not built, "the second build did not wait"
        build(["operator"], folder)
    other.join(5)
    assert built == [["operator"]], "the waiting build built what the first one made"
    assert images.archives(["operator", "sidecar"]) == {
        "operator": folder / "operator.tar", "sidecar": folder / "sidecar.tar"}
    assert built[-1] == ["sidecar"]


def test_pruning_keeps_the_newest_sources_and_never_a_folder_being_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "cache_dir", lambda: tmp_path)
    folders = [tmp_path / f"source{i}" for i in range(6)]  # source0 the newest
    for age, folder in enumerate(folders):
        folder.mkdir()
        for target in images.TARGETS:
            (folder / f"{target}.tar").write_bytes(b"image")
        if age >= 4:  # a finished build's lock (source4), one held by a build (source5)
            (folder / ".build.lock").touch()
        os.utime(folder, (1e9 - age, 1e9 - age))
    with open(folders[5] / ".build.lock") as lock:  # another clone building the oldest
        fcntl.flock(lock, fcntl.LOCK_EX)
        images._prune(folders[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "source0", "source1", "source2", "source5"]
    assert {p.name for p in folders[0].iterdir()} == {f"{t}.tar" for t in images.TARGETS}
    for older in (folders[1], folders[2]):
        assert {p.name for p in older.iterdir()} == {"operator.tar", "sidecar.tar"}
    assert (folders[5] / "trainer.tar").exists(), "the build under way lost its archive"
