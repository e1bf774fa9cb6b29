"""Shared pytest configuration: fixtures live in tests/fixtures/, one module per real part."""

import os
import sys

import pytest

from gemini_local.processes import venv_tools_env

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
    "tests.fixtures.monitoring",
    "tests.proofs",
]


_LAYER_DIRS = ("integration", "cluster", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test under tests/<layer>/ must carry a layer marker, or CI would run it in the unit
    layer (it once did: an S3 test ran with the unit tests)."""
    unmarked = [item.nodeid for item in items if _in_layer_dir(item)
                and not any(item.get_closest_marker(layer) for layer in _LAYER_DIRS)]
    if unmarked:
        raise pytest.UsageError("tests without their layer's marker (add pytestmark): "
                                + ", ".join(unmarked))


def _in_layer_dir(item: pytest.Item) -> bool:
    parts = item.path.relative_to(item.config.rootpath).parts
    return len(parts) > 2 and parts[0] == "tests" and parts[1] in _LAYER_DIRS
