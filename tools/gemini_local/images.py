"""The Dockerfile's images for real kubelet nodes, as OCI archives `ctr images import` takes.

Built by hack/build-images.sh (buildah over a Debian-built Python base, no Docker daemon) and
kept outside the clone, under `$GEMINI_CACHE/images/<key>/<target>.tar`, where the key hashes
every file the Dockerfile copies: an unchanged source tree is never built twice (two runs
wanting the same source's images take turns, the second using what the first built).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gemini_local.controlplane import REPO_ROOT, cache_root

BUILD_SCRIPT = REPO_ROOT / "hack" / "build-images.sh"
CHART = REPO_ROOT / "helm" / "gemini-operator" / "Chart.yaml"
TARGETS = ("operator", "sidecar", "trainer", "examples")
# What the Dockerfile copies (its .dockerignore lets only these into the build context; not
# README.md, of which the images get a stand-in).
_INPUTS = ("Dockerfile", ".dockerignore", "requirements.lock", "pyproject.toml", "gemini", "cli",
           "operator", "trainer_sidecar", "examples/train_gpt_zero3.py", "examples/train_fsdp.py")
_KEEP = 3
_LARGE = ("trainer", "examples")  # torch and its CUDA libraries: 3 GB archives
_SKIPPED = re.compile(r"(__pycache__|\.pyc$|\.egg-info)")


class ImageError(RuntimeError):
    """An image cannot be built; the message says why."""


def cache_dir() -> Path:
    return cache_root() / "images"


def version() -> str:
    """The images' tag: the chart's appVersion (what the chart and the examples name)."""
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?', CHART.read_text(), re.MULTILINE)
    if match is None:
        raise ImageError(f"no appVersion in {CHART}")
    return match.group(1)


def image_name(target: str) -> str:
    """The image's name as a pod names it (`gemini-operator:0.1.0`)."""
    return f"gemini-{target}:{version()}"


def full_name(target: str) -> str:
    """The name the kubelet asks containerd for (a short name is Docker Hub's library)."""
    return f"docker.io/library/{image_name(target)}"


def source_key(root: Path = REPO_ROOT) -> str:
    """A hash of every file the Dockerfile copies (paths and contents)."""
    digest = hashlib.sha256()
    for name in _INPUTS:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            relative = str(path.relative_to(root))
            if _SKIPPED.search(relative):
                continue
            digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def archives(targets: list[str]) -> dict[str, Path]:
    """The OCI archive of each target, built first when the cache has none for this source."""
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ImageError(f"unknown image {unknown[0]!r}; the Dockerfile builds {TARGETS}")
    folder = cache_dir() / source_key()
    if any(not (folder / f"{t}.tar").exists() for t in targets):
        with _building(folder):  # another build of this source may have made them meanwhile
            missing = [t for t in targets if not (folder / f"{t}.tar").exists()]
            if missing:
                _build(missing, folder)
    return {t: folder / f"{t}.tar" for t in targets}


@contextlib.contextmanager
def _building(folder: Path) -> Iterator[None]:
    """One build of a source at a time; its holder removes what a killed build left (a
    SIGKILL or an unhandled SIGTERM skips the temporary folder's cleanup: gigabytes)."""
    if os.geteuid() != 0:
        raise ImageError("building images needs root (buildah with chroot isolation)")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in folder.glob(".build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        yield


def _build(targets: list[str], folder: Path) -> None:
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
        result = subprocess.run(["bash", str(BUILD_SCRIPT), "--oci-dir", tmp, *targets],
                                stdout=subprocess.PIPE, text=True, check=False)
        if result.returncode != 0:
            raise ImageError(f"{BUILD_SCRIPT.name} {' '.join(targets)} failed (exit "
                             f"{result.returncode}); its output is above")
        for target in targets:
            os.replace(Path(tmp) / f"{target}.tar", folder / f"{target}.tar")
    _prune(folder)


def _prune(current: Path) -> None:
    """Keep the newest few sources' archives (two clones may alternate) and the 3 GB trainer
    images of the current one only; a folder another clone is building (its lock held) is
    left alone."""
    kept = sorted((d for d in cache_dir().iterdir() if d.is_dir() and d != current),
                  key=lambda d: d.stat().st_mtime, reverse=True)
    for index, old in enumerate(kept):
        with _unless_building(old) as free:
            if free and index >= _KEEP - 1:
                shutil.rmtree(old, ignore_errors=True)
            elif free:
                for big in _LARGE:
                    (old / f"{big}.tar").unlink(missing_ok=True)


@contextlib.contextmanager
def _unless_building(folder: Path) -> Iterator[bool]:
    """Holds the folder's build lock if no build holds it (yields False if one does)."""
    lock_path = folder / ".build.lock"
    if not lock_path.exists():
        yield True
        return
    with open(lock_path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
