"""A status writer for a training step tested on its own (core.status_changes.StatusWriter):
what the step writes ahead and what it sets for the final write, as the JSON they stand for."""

from __future__ import annotations

from typing import Any

from gemini_operator.core.status import JobStatus
from gemini_operator.core.status_changes import StatusChange


class NotedStatus:
    def __init__(self, decided: JobStatus | None = None) -> None:
        self.decided = decided or JobStatus()
        self.written: list[dict[str, Any]] = []  # written ahead, in order
        self.kept: list[dict[str, Any]] = []  # set for the final write

    def ahead(self, change: StatusChange) -> None:
        self.written.append(change.fields(self.decided))

    def set(self, change: StatusChange) -> None:
        self.kept.append(change.fields(self.decided))
