"""Image build time and sizes: the Dockerfile's images built here without a Docker daemon
(hack/build-images.sh: buildah over a Debian-built Python base).

For each target: the build's wall time (base image already made; the first run also times
making it), the unpacked size (the root file system's bytes, what `docker images` shows) and
the OCI archive's size (gzip layers: about what a node pulls).

    .venv/bin/python bench/images.py [--targets operator sidecar] [--keep-archives DIR]

Target (issue 15): operator image <= 300 MB unpacked. The last line is one JSON object.
Needs root (apt-get for buildah and mmdebstrap on first use, buildah itself) and PyPI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_MB = 300.0
MB = 1e6


def build(targets: list[str], oci_dir: Path) -> list[dict[str, object]]:
    """Build `targets`; one row per image: name, unpacked and archive bytes, seconds."""
    started = time.monotonic()
    out = subprocess.run([str(ROOT / "hack/build-images.sh"), "--oci-dir", str(oci_dir),
                          *targets], check=True, stdout=subprocess.PIPE, text=True).stdout
    rows = []
    for line in out.splitlines():
        target, name, size, seconds = line.split()
        rows.append({"target": target, "image": name, "unpacked_mb": round(int(size) / MB, 1),
                     "archive_mb": round((oci_dir / f"{target}.tar").stat().st_size / MB, 1),
                     "build_seconds": float(seconds)})
    print(f"built {', '.join(targets)} in {time.monotonic() - started:.0f} s "
          "(the base image included when it was not there yet)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=["operator", "sidecar"],
                        help="Dockerfile targets (trainer and examples carry torch: GBs, minutes)")
    parser.add_argument("--keep-archives", type=Path,
                        help="leave the OCI archives here (default: a temporary folder)")
    args = parser.parse_args()
    if "operator" not in args.targets:
        sys.exit("--targets must include operator: the figure is its size")
    with tempfile.TemporaryDirectory(prefix="gemini-images-") as tmp:
        rows = build(args.targets, args.keep_archives or Path(tmp))
    for row in rows:
        print(f"{row['image']}: {row['unpacked_mb']} MB unpacked, {row['archive_mb']} MB as an"
              f" OCI archive, built in {row['build_seconds']} s", flush=True)
    operator = next(r for r in rows if r["target"] == "operator")
    print(json.dumps({"metric": "operator_image_unpacked_mb", "value": operator["unpacked_mb"],
                      "target": TARGET_MB, "better": "lower", "unit": "MB", "images": rows}))


if __name__ == "__main__":
    main()
