"""Uninterrupted reference runs, cached by content across runs.

A reference's losses depend only on what it runs: the script, the trainer library, the locked
packages, the interpreter, the CPU (kernels differ by instruction set), the world size and the
arguments less `--steps` (a step's loss does not depend on how many follow: the warm-up is a
fixed number of steps) and `--step-sleep` (idle time). One run per such content serves every
later request for as many steps or fewer; a request for more runs again and replaces it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from gemini_local.controlplane import REPO_ROOT, cache_root

STEPS, STEP_SLEEP = "--steps", "--step-sleep"
TRAINER_LIBRARY = REPO_ROOT / "trainer_sidecar" / "gemini_trainer"
LOCK = REPO_ROOT / "requirements.lock"

Losses = list[dict[int, str]]  # every rank's step -> loss (float hex)


def without_option(args: Sequence[str], option: str) -> list[str]:
    """`args` less every `option VALUE` pair."""
    out = list(args)
    while option in out:
        at = out.index(option)
        del out[at:at + 2]
    return out


def steps_asked(args: Sequence[str]) -> int | None:
    """The `--steps` value, None when the script's default applies."""
    return int(args[args.index(STEPS) + 1]) if STEPS in args else None


def content_args(args: Sequence[str]) -> list[str]:
    """The arguments a step's loss depends on."""
    return without_option(without_option(args, STEPS), STEP_SLEEP)


def _cpu_identity() -> bytes:
    """The first CPU's model and flags: what decides which kernels torch runs."""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        first = text.split("\n\n", 1)[0]
        return "\n".join(line for line in first.splitlines()
                         if line.startswith(("model name", "flags"))).encode()
    return b"unknown"


def content_digest(script: Path, world: int, args: Sequence[str],
                   env: Mapping[str, str] | None = None) -> str:
    """`env`: what the run sets beyond the ranks' own variables."""
    digest = hashlib.sha256()
    settings = "\0".join(f"{k}={v}" for k, v in sorted((env or {}).items()))
    for part in (str(world), "\0".join(content_args(args)), settings, sys.version):
        digest.update(part.encode() + b"\0")
    files = [script, LOCK, *sorted(TRAINER_LIBRARY.rglob("*.py"))]
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(_cpu_identity())
    return digest.hexdigest()[:24]


class ReferenceCache:
    """`folder/<content digest>.json`: the longest run of that content, every rank's losses."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or cache_root() / "references"

    def get(self, script: Path, world: int, args: Sequence[str],
            env: Mapping[str, str] | None = None) -> Losses | None:
        """Every rank's losses up to the steps `args` asks for; None when no run that long
        is cached (or the steps are the script's default)."""
        steps = steps_asked(args)
        if steps is None:
            return None
        try:
            stored = json.loads(self._path(script, world, args, env).read_text())
        except (OSError, ValueError):
            return None
        if stored.get("steps", 0) < steps or len(stored.get("losses", ())) != world:
            return None
        return [{int(s): loss for s, loss in rank.items() if int(s) <= steps}
                for rank in stored["losses"]]

    def put(self, script: Path, world: int, args: Sequence[str], losses: Losses,
            env: Mapping[str, str] | None = None) -> None:
        """Keep `losses` unless a longer run of the same content is kept already."""
        steps = steps_asked(args)
        if steps is None or any(sorted(rank) != list(range(1, steps + 1)) for rank in losses):
            return  # only complete runs serve as a reference
        path = self._path(script, world, args, env)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("steps", 0) >= steps:
                return
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"steps": steps, "world": world, "script": str(script),
                "args": content_args(args), "losses": [{str(s): v for s, v in rank.items()}
                                                       for rank in losses]}
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(handle, "w") as out:
            json.dump(body, out)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new

    def _path(self, script: Path, world: int, args: Sequence[str],
              env: Mapping[str, str] | None) -> Path:
        return self.folder / f"{content_digest(script, world, args, env)}.json"
