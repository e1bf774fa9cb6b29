"""Shared pytest configuration: fixtures live in tests/fixtures/, one module per real part."""

import os
import sys
from pathlib import Path

# Every process the tests start finds this environment's tools first: torch builds DeepSpeed's
# JIT ops with the `ninja` on PATH, and two ninja versions (the venv's and Debian's) disagree on
# the build log's command hashes, so alternating between them rebuilds the op on every start.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# One JIT build directory per checkout (as ./dev sets it): checkouts sharing one rebuild it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.executable).parent.parent
                                                  / "torch-extensions"))

pytest_plugins: list[str] = [
    "tests.fixtures.cluster",
    "tests.fixtures.nodes",
    "tests.fixtures.s3",
    "tests.fixtures.operator",
    "tests.fixtures.trainers",
    "tests.fixtures.helm",
    "tests.fixtures.kwok",
    "tests.fixtures.isolated_nodes",
]
