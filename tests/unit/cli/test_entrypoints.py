"""Production entrypoints import no dev tools: `gemini operator run`, `gemini sidecar` and
`gemini launch` run in images without the local cluster, the demo or plotting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

DEV_ONLY = ("gemini_local", "gemini_demo", "matplotlib")
# Only the sidecar's peer protocol uses cryptography (Poly1305); the others load none of it.
SIDECAR_ONLY = ("cryptography",)

# What each command imports to run: its parser, then the modules its `func` imports.
ENTRYPOINTS = {
    "operator run": (["operator", "run"], ["gemini_operator.main", "gemini_operator.render"]),
    "sidecar": (["sidecar"], ["gemini_sidecar.app", "gemini_sidecar.config"]),
    "launch": (["launch", "--", "true"], ["gemini_trainer.launcher"]),
}

PROBE = """
import importlib, json, sys
from gemini_cli import build_parser
argv, modules = json.loads(sys.argv[1])
build_parser(argv).parse_args(argv)
for name in modules:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {dev})))
"""


def loaded_dev_modules(argv: list[str], modules: list[str],
                       packages: tuple[str, ...] = DEV_ONLY) -> list[str]:
    code = PROBE.format(dev=set(packages))
    out = subprocess.run([sys.executable, "-c", code, json.dumps([argv, modules])],
                         capture_output=True, text=True, check=True, timeout=120)
    return list(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("name", sorted(ENTRYPOINTS))
def test_a_production_entrypoint_imports_no_dev_tool(name):
    argv, modules = ENTRYPOINTS[name]
    assert loaded_dev_modules(argv, modules) == []


@pytest.mark.parametrize("name", ["operator run", "launch"])
def test_only_the_sidecar_loads_cryptography(name):
    argv, modules = ENTRYPOINTS[name]
    assert loaded_dev_modules(argv, modules, SIDECAR_ONLY) == []
    assert loaded_dev_modules(*ENTRYPOINTS["sidecar"], SIDECAR_ONLY) != []


def test_the_probe_sees_a_dev_tool_when_one_is_imported():
    # The check above can fail: a dev command's parser does import the local cluster.
    assert "gemini_local" in loaded_dev_modules(["local", "status"], [])
