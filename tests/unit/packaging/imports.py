"""The third-party distributions the shipped Python packages import, and what the project
declares it needs at run time ([project].dependencies and its extras, with their own
dependencies, as installed)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
SOURCE_DIRS = (ROOT / "gemini", ROOT / "operator", ROOT / "trainer_sidecar", ROOT / "cli")
FIRST_PARTY = {"gemini", "gemini_cli", "gemini_demo", "gemini_local", "gemini_operator",
               "gemini_sidecar", "gemini_trainer"}


def _is_guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside `if TYPE_CHECKING:` or a `try` that handles ImportError: not needed to run."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
        if isinstance(node, ast.Try) and any(
            h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers
        ):
            return True
    return False


def imported_modules(path: Path) -> Iterator[str]:
    """Top-level names of the absolute imports a file needs to run."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and not _is_guarded(node, parents):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and not _is_guarded(node, parents)):
            yield node.module.split(".")[0]


def dotted_imports(path: Path, package: str = "") -> Iterator[str]:
    """The full dotted names a file imports (`from a.b import c` gives a.b and a.b.c); relative
    imports are resolved against `package`, the dotted package the file is in."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, node.module] if node.module else base)
            if node.level == 0:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def third_party_imports() -> dict[str, set[Path]]:
    """Each third-party top-level module imported by the shipped code, and where."""
    found: dict[str, set[Path]] = {}
    for source in SOURCE_DIRS:
        for path in source.rglob("*.py"):
            for name in imported_modules(path):
                if name in FIRST_PARTY or name in sys.stdlib_module_names or name == "__future__":
                    continue
                found.setdefault(name, set()).add(path.relative_to(ROOT))
    return found


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str, extras: Iterable[str]) -> Iterator[Requirement]:
    for raw in metadata.requires(dist) or []:
        req = Requirement(raw)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            yield req


def runtime_closure(extras: Iterable[str]) -> set[str]:
    """Canonical names of every distribution the project needs at run time with `extras`:
    pyproject's dependencies (and those extras), then their dependencies, as installed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_requirements(req.name, req.extras))
        except metadata.PackageNotFoundError:
            continue  # not installed for this platform (an unmet marker further up)
    return seen


def distributions_of(module: str) -> set[str]:
    return {_canonical(d) for d in metadata.packages_distributions().get(module, [])}
