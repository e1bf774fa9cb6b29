"""Production entrypoints import no dev tools: `gemini operator run`, `gemini sidecar` and
`gemini launch` run in images without the local cluster, the demo or plotting; and the
operator and the launcher need nothing of the `sidecar` extra (the operator image has none)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

DEV_ONLY = ("gemini_local", "gemini_demo", "matplotlib")
# The modules of the `sidecar` extra (pyproject.toml; botocore comes with boto3): the operator
# image does not install them, so `gemini operator run` and `gemini launch` must not load them.
SIDECAR_ONLY = ("boto3", "botocore", "numpy", "isal")
PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"

# What each command imports to run: its parser, then the modules its `func` imports.
ENTRYPOINTS = {
    "operator run": (["operator", "run"],
                     ["gemini_operator.runtime.main", "gemini_operator.core.render"]),
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
def test_only_the_sidecar_loads_the_sidecar_extra(name):
    argv, modules = ENTRYPOINTS[name]
    assert loaded_dev_modules(argv, modules, SIDECAR_ONLY) == []
    assert set(loaded_dev_modules(*ENTRYPOINTS["sidecar"], SIDECAR_ONLY)) >= {
        "boto3", "numpy", "isal"}


def test_the_sidecar_extra_is_what_the_check_above_looks_for():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extra = {Requirement(r).name for r in project["optional-dependencies"]["sidecar"]}
    assert extra == set(SIDECAR_ONLY) - {"botocore"}
    assert not extra & {Requirement(r).name for r in project["dependencies"]}


def test_a_command_whose_extra_is_missing_says_how_to_install_it(monkeypatch, capsys):
    import gemini_cli

    def missing(_args):
        raise ModuleNotFoundError("No module named 'boto3'", name="boto3")

    args = gemini_cli.build_parser(["sidecar"]).parse_args(["sidecar"])
    monkeypatch.setattr(args, "func", missing)
    assert gemini_cli.run(args) == 2
    err = capsys.readouterr().err
    assert "`gemini sidecar` needs the `sidecar` extra" in err
    assert "pip install 'gemini-operator[sidecar]'" in err


def test_the_probe_sees_a_dev_tool_when_one_is_imported():
    # The check above can fail: a dev command's parser does import the local cluster.
    assert "gemini_local" in loaded_dev_modules(["local", "status"], [])
