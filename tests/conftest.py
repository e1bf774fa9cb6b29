"""Shared pytest configuration: fixtures live in tests/fixtures/, one module per real part."""

import os
import sys

from gemini.local.processes import venv_tools_env

# Every process the tests start finds this environment's tools (ninja) and JIT builds first.
os.environ.update(venv_tools_env(sys.executable, os.environ))

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
