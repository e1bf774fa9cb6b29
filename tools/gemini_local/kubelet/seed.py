"""One containerd image store that every kubelet node's containerd starts from.

Importing the examples image (torch with its CUDA libraries: 5.5 GB unpacked) into each node's
containerd took more than a minute and 11 GB of disk per node. The archives are imported once
into a seed store kept in the cache (`$GEMINI_CACHE/containerd-seed`); a node's containerd root
starts as a copy of it in which the image content and the unpacked layers are hard links and
every other file (the metadata databases) a real copy. containerd writes neither in place: a
blob is written once, a committed snapshot is only ever an overlay lower dir, and removing
either unlinks it. A later import of a changed image unpacks only the layers that changed (the
thin top layer of a code change); what it replaced is garbage-collected at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from gemini_local.controlplane import cache_root

# Under a containerd root: what is shared by hard links (never written in place).
_LINKED = ("io.containerd.content.v1.content/blobs",
           "io.containerd.snapshotter.v1.overlayfs/snapshots")
_STAMP = "imported.json"  # image name -> the archive's identity, as last imported
_GC_TRIGGER = "gemini.local/seed-gc:1"
_NAMESPACE = "k8s.io"  # the CRI's: where the kubelet looks for images
Ctr = Callable[..., str]


class SeedError(RuntimeError):
    """The seed store cannot be prepared or copied; the message says why."""


def seed_dir() -> Path:
    return cache_root() / "containerd-seed"


def links_reach(folder: Path, seed: Path | None = None) -> bool:
    """Whether hard links from the seed (the cache's, unless given) reach `folder`: the same
    file system."""
    return (seed or seed_dir().parent).stat().st_dev == folder.stat().st_dev


def prepare(images: Mapping[str, tuple[Path, str]]) -> Path:
    """Import into the seed each image (name -> (OCI archive, also-known-as name)) whose archive
    changed since it was last imported; the seed's containerd root."""
    seed = seed_dir()
    seed.mkdir(parents=True, exist_ok=True)
    with _locked(seed / ".lock"):
        stamp = seed / _STAMP
        done = json.loads(stamp.read_text()) if stamp.exists() and (seed / "root").exists() \
            else {}
        todo = {name: what for name, what in images.items() if done.get(name) != _identity(
            what[0])}
        if todo:
            with _containerd(seed / "root") as ctr:
                for name, (archive, alias) in todo.items():
                    ctr("images", "import", str(archive))
                    ctr("images", "tag", "--force", name, alias)
                    done[name] = _identity(archive)
                    stamp.write_text(json.dumps(done, indent=1))
                # What the imports replaced (older manifests, their layers) goes now: a
                # synchronous delete runs containerd's garbage collection.
                ctr("images", "tag", "--force", next(iter(todo)), _GC_TRIGGER)
                ctr("images", "rm", "--sync", _GC_TRIGGER)
    return seed / "root"


def clone(seed_root: Path, root: Path) -> None:
    """Make `root` (absent) a containerd root with the seed's images: content and layers hard
    linked, everything else copied."""
    if not links_reach(root.parent, seed_root):
        raise SeedError(f"{root} is on another file system than the image seed {seed_root}: "
                        "hard links cannot reach it")
    with _locked(seed_root.parent / ".lock"):
        result = subprocess.run(["cp", "-a", "--link", str(seed_root), str(root)],
                                capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SeedError(f"copying the image seed to {root} failed: {result.stderr.strip()}")
    for path in _private_files(root):
        copy = path.with_name(path.name + ".copy")
        shutil.copy2(path, copy)
        os.replace(copy, path)


def _private_files(root: Path) -> Iterator[Path]:
    """Regular files outside the linked trees: the databases each containerd writes."""
    for folder, dirs, files in os.walk(root):
        relative = Path(folder).relative_to(root)
        dirs[:] = [d for d in dirs if str(relative / d) not in _LINKED]
        for name in files:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                yield path


def _identity(archive: Path) -> str:
    info = archive.stat()
    return f"{archive.resolve()}:{info.st_size}:{info.st_mtime_ns}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _containerd(root: Path) -> Iterator[Ctr]:
    """A containerd of the seed's own (no CRI, no kubelet); `ctr(*args)` runs against it."""
    with tempfile.TemporaryDirectory(prefix="gemini-seed-") as tmp:
        socket = Path(tmp) / "containerd.sock"
        config = Path(tmp) / "config.toml"
        config.write_text(f'version = 2\nroot = "{root}"\nstate = "{tmp}/state"\n'
                          'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                          f'[grpc]\n  address = "{socket}"\n'
                          f'[ttrpc]\n  address = "{socket}.ttrpc"\n'
                          f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{tmp}/opt"\n')
        log = (Path(tmp) / "containerd.log").open("w")
        daemon = subprocess.Popen(["containerd", f"--config={config}"], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)

        def ctr(*args: str) -> str:
            result = subprocess.run(
                ["ctr", f"--address={socket}", f"--namespace={_NAMESPACE}", *args],
                capture_output=True, text=True, timeout=900, check=False)
            if result.returncode != 0:
                raise SeedError(f"ctr {' '.join(args)} (image seed) failed: "
                                f"{result.stderr.strip()}")
            return result.stdout

        try:
            _wait_until_serving(ctr, daemon, Path(tmp) / "containerd.log")
            yield ctr
        finally:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
            log.close()


def _wait_until_serving(ctr: Ctr, daemon: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SeedError(f"the image seed's containerd exited: {log.read_text()[-2000:]}")
        try:
            ctr("version")
            return
        except SeedError:
            time.sleep(0.2)
    raise SeedError(f"the image seed's containerd did not serve in 30 s: "
                    f"{log.read_text()[-2000:]}")
