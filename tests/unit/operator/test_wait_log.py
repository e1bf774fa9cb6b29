"""A recovery asked again every 0.25 s logs what it waits for once per change, not 4 times a
second ("rank 3: replacement is Pending" was logged ~10 times a second)."""

from __future__ import annotations

import logging

from gemini_operator.steps.recovery import WAIT_LOG_REPEAT_S, WaitLog

JOB, OTHER = ("ns", "a"), ("ns", "b")


def test_a_wait_is_logged_loudly_once_per_change_and_again_after_a_while() -> None:
    now = [0.0]
    waits = WaitLog(clock=lambda: now[0])
    levels = []
    for message in ("rank 3: replacement is Pending", "rank 3: replacement is Pending",
                    "transfers under way: rank 3: fetch 10 of 271 MB",
                    "transfers under way: rank 3: fetch 150 of 271 MB",
                    "rank 3: replacement is Pending"):
        levels.append(waits.level(JOB, message))
        now[0] += 0.25
    assert levels == [logging.INFO, logging.DEBUG, logging.INFO, logging.DEBUG, logging.INFO]
    assert waits.level(OTHER, "rank 3: replacement is Pending") == logging.INFO
    now[0] += WAIT_LOG_REPEAT_S
    assert waits.level(JOB, "rank 3: replacement is Pending") == logging.INFO
