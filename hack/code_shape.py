"""The code's large shape, for the house issues: the largest modules and classes, and the
modules and functions one reconcile call of the operator passes through.

    .venv/bin/python hack/code_shape.py [--top N]

The reconcile is a new two-node job's first one (it creates the secret, service, network
policy and pods) against an in-memory stand-in for the API server; "places" are the distinct
product functions and methods it runs (comprehensions and lambdas not counted), in every
thread.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import pkgutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["gemini", "operator/gemini_operator", "trainer_sidecar/gemini_sidecar",
           "trainer_sidecar/gemini_trainer", "cli/gemini_cli", "tools/gemini_demo",
           "tools/gemini_local"]
PRODUCT = ("gemini", "gemini_operator")
RECONCILES = 2  # a new job's first reconcile records its start; the second creates its parts


def python_files() -> Iterator[Path]:
    for source in SOURCES:
        yield from sorted((ROOT / source).rglob("*.py"))


def largest_modules(top: int) -> list[tuple[int, str]]:
    sizes = [(len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in python_files()]
    return sorted(sizes, reverse=True)[:top]


def largest_classes(top: int) -> list[tuple[int, str]]:
    found = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body
                           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
                found.append((len(methods), f"{node.name} ({path.relative_to(ROOT)})"))
    return sorted(found, reverse=True)[:top]


def find(name: str) -> Any:
    """`name` from whichever gemini_operator module defines it (modules move between layouts)."""
    package = importlib.import_module("gemini_operator")
    for info in pkgutil.walk_packages(package.__path__, "gemini_operator."):
        if info.name.endswith(("main", "handlers")):
            continue  # they start kopf on import
        module: ModuleType = importlib.import_module(info.name)
        value = getattr(module, name, None)
        if value is not None and getattr(value, "__module__", None) == info.name:
            return value
    raise LookupError(name)


class Api:
    """The API server as a first reconcile of a new job touches it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        if name.startswith(("get_", "secret_value", "priority_value")):
            return lambda *a, **k: None
        if name.startswith("list_"):
            return lambda *a, **k: []
        if name == "exists":
            return lambda *a, **k: False
        if name.startswith("create"):
            return lambda *a, **k: True
        return lambda *a, **k: None


def reconcile_walk() -> tuple[set[str], set[tuple[str, str]], list[str]]:
    """The modules and (module, function) places one first reconcile runs through."""
    job = {"apiVersion": "gemini.ai/v1alpha1", "kind": "GeminiJob",
           "metadata": {"name": "walk", "namespace": "default", "uid": "walk-uid",
                        "generation": 1, "resourceVersion": "1"},
           "spec": {"numNodes": 2, "template": {"image": "python:3.11",
                                                "command": ["python", "train.py"]}}}
    api, cache = Api(), find("ClusterCache")()

    def patch_job_status(namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        job["status"] = {**job.get("status", {}), **patch}
        job["metadata"]["resourceVersion"] = str(int(job["metadata"]["resourceVersion"]) + 1)
        api.calls.append("patch_job_status")
        cache.update_job(copy.deepcopy(job), deleted=False)
        return copy.deepcopy(job)

    api.patch_job_status = patch_job_status
    cache.update_job(copy.deepcopy(job), deleted=False)
    config = find("ReconcileConfig")(default_sidecar_image="gemini:side")
    reconciler = find("build_reconciler")(api, cache, config)
    places: set[tuple[str, str]] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.split(".")[0] in PRODUCT and "<" not in frame.f_code.co_qualname:
                places.add((module, frame.f_code.co_qualname))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        for _ in range(RECONCILES):
            reconciler.reconcile(("default", "walk"))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert job["status"].get("state") != "Failed", job["status"]
    return {m for m, _ in places}, places, api.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    for dirname in ("operator", "trainer_sidecar", "cli", "tools", "."):
        sys.path.insert(0, str(ROOT / dirname))
    print("largest modules (lines):")
    for lines, path in largest_modules(args.top):
        print(f"  {lines:5d}  {path}")
    print("largest classes (methods):")
    for methods, name in largest_classes(args.top):
        print(f"  {methods:5d}  {name}")
    modules, places, created = reconcile_walk()
    print(f"a new job's first {RECONCILES} reconciles (API calls: {', '.join(created)}): "
          f"{len(places)} places in {len(modules)} modules")
    for module in sorted(modules):
        print(f"  {module}: {sum(1 for m, _ in places if m == module)}")


if __name__ == "__main__":
    main()
