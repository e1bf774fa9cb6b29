"""OCI image-layout tarballs of one static binary, for `ctr images import` without a registry.

The tarball holds `oci-layout`, `index.json` (its one manifest annotated with
`io.containerd.image.name`, the name the image gets in containerd), the manifest, the config
(entrypoint and `rootfs.diff_ids`) and one gzip layer with the binary at `/<name>`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer_tar(binary: Path, name: str) -> bytes:
    """An uncompressed layer: the binary at /<name>, root-owned, mode 0755, time 0."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = binary.read_bytes()
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def write_image(binary: Path, image_name: str, out: Path, entry: str = "pause") -> Path:
    """Write an OCI image-layout tarball to `out`: image `image_name` (e.g.
    `gemini.local/pause:1`) whose entrypoint is `binary`, copied to `/<entry>`. Returns `out`."""
    layer = _layer_tar(binary, entry)
    layer_gz = gzip.compress(layer, mtime=0)
    config = _json({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": [f"/{entry}"], "Env": ["PATH=/"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
    })
    manifest = _json({
        "schemaVersion": 2, "mediaType": _MANIFEST,
        "config": {"mediaType": _CONFIG, "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": _LAYER, "digest": _digest(layer_gz), "size": len(layer_gz)}],
    })
    index = _json({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": _MANIFEST, "digest": _digest(manifest), "size": len(manifest),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": image_name,
                            "org.opencontainers.image.ref.name": image_name.rsplit(":", 1)[-1]},
        }],
    })
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": index}
    for blob in (layer_gz, config, manifest):
        files["blobs/sha256/" + _digest(blob).split(":", 1)[1]] = blob
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return out
