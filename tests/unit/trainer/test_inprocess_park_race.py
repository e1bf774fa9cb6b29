"""gemini_trainer.inprocess: a SIGUSR1 (the launcher asking to park) that lands while a
failed attempt is being handled parks the process like the failure itself; it never raises
out of the attempt (CI saw a survivor exit 1 with RestartRequested and be replaced by a fresh
process instead of restarting in place)."""

from __future__ import annotations

import traceback

import pytest

from gemini_trainer import inprocess


class Link:
    """The launcher's line, noting what the process said on it."""

    def __init__(self) -> None:
        self.said: list[str] = []

    def parking(self) -> None:
        self.said.append("parking")


def test_a_park_request_while_a_failure_is_formatted_does_not_escape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    link = Link()
    format_exc = traceback.format_exc

    def signal_lands_meanwhile() -> str:
        inprocess._on_sigusr1(link)  # type: ignore[arg-type]  # as the signal handler runs it
        return format_exc()

    monkeypatch.setattr(inprocess.traceback, "format_exc", signal_lands_meanwhile)

    def main() -> None:
        raise ConnectionError("a peer died mid-collective")

    failure = inprocess._attempt(main)
    assert failure is not None and "a peer died mid-collective" in failure
    # No second exception; the launcher hears that a park is coming (it then waits past its
    # grace for the park, which run() sends next).
    assert link.said == ["parking"]
    inprocess._failing.clear()


def test_a_park_request_while_main_runs_is_its_failure() -> None:
    link = Link()

    def main() -> None:
        inprocess._on_sigusr1(link)  # type: ignore[arg-type]

    failure = inprocess._attempt(main)
    assert failure is not None and "RestartRequested" in failure
    assert link.said == ["parking"]
