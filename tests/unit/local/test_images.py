"""The image cache key: every file the Dockerfile copies, and nothing else."""

from __future__ import annotations

from pathlib import Path

from gemini_local import images


def _tree(root: Path) -> None:
    for name in ("Dockerfile", ".dockerignore", "requirements.lock", "pyproject.toml",
                 "README.md", "operator/gemini_operator/x.py", "tests/test_x.py",
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


def test_images_are_named_as_the_chart_names_them() -> None:
    chart = (images.CHART.parent / "values.yaml").read_text()
    assert "repository: gemini-operator" in chart and "repository: gemini-sidecar" in chart
    assert images.image_name("operator") == f"gemini-operator:{images.version()}"
    assert images.full_name("sidecar") == f"docker.io/library/gemini-sidecar:{images.version()}"
