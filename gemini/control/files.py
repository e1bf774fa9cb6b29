"""The files the trainer and the launcher write in the shared memory volume for the sidecar
(and a status reader) to read: the heartbeat and the parked marker."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gemini.control.launcher import PARKED_ERROR_CHARS, Parked, Progress
from gemini.control.strict import Fields


def read_heartbeat(path: Path) -> Progress | None:
    """The last heartbeat in `path` ("<step> <unix time>", written by the trainer library);
    None when there is none yet or it cannot be read."""
    try:
        step_text, when_text = path.read_text().split()[:2]
        step, when = int(step_text), float(when_text)
    except (OSError, ValueError):
        return None
    return Progress(step, when, max(0.0, time.time() - when))


def parked_path(heartbeat: Path) -> Path:
    return heartbeat.with_name(heartbeat.name + ".parked")


def write_parked(path: Path, parked: Parked) -> None:
    write_atomically(path, json.dumps(parked.to_json()))


def write_atomically(path: Path, text: str) -> None:
    """Readers (the sidecar, a status reader) see the old file or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_parked(path: Path) -> Parked | None:
    """The parked marker in `path`; None when there is none or it cannot be read."""
    try:
        doc = json.loads(path.read_text()[: 4 * PARKED_ERROR_CHARS])
        return Parked.read(Fields(doc, str(path)))
    except (OSError, ValueError):
        return None
