"""The trainer's restart timeline: each event printed once per restart order, with the seconds
since the order; nothing without an order (a first start under plain torchrun)."""

from __future__ import annotations

import time

import pytest

from gemini_trainer import timeline


def test_each_event_is_printed_once_per_restart_order(capsys: pytest.CaptureFixture[str]) -> None:
    order = {timeline.ENV: f"{time.time() - 1.5:.3f}"}
    after = timeline.mark("built", order)
    assert after is not None and 1.4 < after < 10
    assert timeline.mark("built", order) is None  # a second Checkpointer of the same attempt
    assert timeline.mark("restored step 7", order) is not None
    later = {timeline.ENV: f"{time.time():.3f}"}  # the next restart: counted again
    assert timeline.mark("built", later) is not None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and lines[0].startswith("gemini: restart timeline: built 1.")
    assert lines[0].endswith(" s after the restart order")


def test_nothing_without_an_order(capsys: pytest.CaptureFixture[str]) -> None:
    assert timeline.mark("built", {}) is None
    assert timeline.mark("built", {timeline.ENV: "soon"}) is None
    assert capsys.readouterr().err == ""
