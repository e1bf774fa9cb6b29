"""Traffic scheduling: idle spans from profiles and Algorithm 2 with its errata corrected."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini.domain.traffic import (
    IdleSpan,
    IterationTimeline,
    LinkModel,
    TrafficError,
    idle_spans,
    schedule_checkpoint,
    span_seconds,
)


@pytest.mark.parametrize(
    ("iterations", "lengths", "min_span", "expected"),
    [
        pytest.param(
            [[(1.0, 2.0), (4.0, 5.0)]],
            [6.0],
            0.0,
            [IdleSpan(0, 0.0, 1.0), IdleSpan(1, 2.0, 2.0), IdleSpan(2, 5.0, 1.0)],
            id="gaps before, between and after the ops",
        ),
        pytest.param(
            [[(1.0, 2.0), (4.0, 5.0)], [(1.5, 2.0), (3.0, 5.0)]],
            [6.0, 7.0],
            0.0,
            [IdleSpan(0, 0.0, 1.0), IdleSpan(1, 2.0, 1.0), IdleSpan(2, 5.0, 1.0)],
            id="each span is the shortest over the iterations",
        ),
        pytest.param(
            [[(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]],
            [4.5],
            0.0,
            [IdleSpan(1, 2.0, 1.0), IdleSpan(2, 4.0, 0.5)],
            id="overlapping ops merge and empty gaps vanish",
        ),
        pytest.param(
            [[(1.0, 2.0), (2.1, 3.0)]],
            [5.0],
            0.5,
            [IdleSpan(0, 0.0, 1.0), IdleSpan(2, 3.0, 2.0)],
            id="spans below the threshold are dropped but keep their gap numbers",
        ),
        pytest.param(
            [[(1.0, 2.0)]],
            None,
            0.0,
            [IdleSpan(0, 0.0, 1.0)],
            id="without iteration lengths the tail gap is unknown",
        ),
        pytest.param(
            [[(1.0, 2.0), (3.0, 4.0)], [(1.0, 2.0)]],
            [5.0, 5.0],
            0.0,
            [IdleSpan(0, 0.0, 1.0), IdleSpan(1, 2.0, 1.0)],
            id="iterations with fewer gaps limit the count",
        ),
    ],
)
def test_idle_spans(iterations, lengths, min_span: float, expected: list[Any]) -> None:
    assert list(idle_spans(iterations, min_span, lengths)) == expected


def test_timelines_can_be_given_as_objects() -> None:
    spans = idle_spans([IterationTimeline(3.0, ((1.0, 2.0),))], 0.0)
    assert [s.length for s in spans] == [1.0, 1.0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda: idle_spans([], 0.0), "at least one iteration", id="no profile"),
        pytest.param(
            lambda: idle_spans([[(2.0, 1.0)]], 0.0),
            "start <= end",
            id="an op ending before it starts",
        ),
        pytest.param(
            lambda: idle_spans([[(0.0, 1.0)]], 0.0, [1.0, 2.0]),
            "2 iteration lengths",
            id="lengths not matching iterations",
        ),
    ],
)
def test_bad_profiles_raise(call, message: str) -> None:
    with pytest.raises(TrafficError, match=message):
        call()


LINK = LinkModel(alpha_seconds=0.1, bandwidth_bytes_per_second=100.0)


def test_budget_shrinks_by_the_chunk_sent_not_by_the_remainder() -> None:
    # Span 1 s, mu 1: chunk 50 B (capped by R/p) costs 0.6 s; then (0.4 - 0.1) * 100 = 30 B
    # fits; the budget is spent, the computed size is 0 and the loop moves on. Printed as in
    # the paper (subtracting f(remaining)), the second chunk would never be sent.
    schedule = schedule_checkpoint(
        [1.0, 10.0], 200, 1, LINK, mu=1.0, buffer_bytes=200, sub_buffers=4
    )
    sent = [(c.span_index, c.size_bytes) for c in schedule.chunks]
    assert sent == [(0, 50), (0, 30), (1, 50), (1, 50), (1, 20)]
    assert schedule.fits_idle_spans and schedule.interval_iterations == 1


def test_the_last_span_is_unbounded_and_the_interval_grows() -> None:
    schedule = schedule_checkpoint(
        [1.0, 1.0], 500, 1, LINK, mu=1.0, buffer_bytes=200, sub_buffers=4
    )
    assert sum(c.size_bytes for c in schedule.chunks) == 500
    assert not schedule.fits_idle_spans
    # One iteration carries 80 + 80 bytes: 500 bytes need 4 iterations.
    assert schedule.interval_iterations == 4
    assert schedule_checkpoint(
        [1.0, 1.0] * 4, 500, 1, LINK, mu=1.0, buffer_bytes=200
    ).fits_idle_spans
    assert not schedule_checkpoint(
        [1.0, 1.0] * 3, 500, 1, LINK, mu=1.0, buffer_bytes=200
    ).fits_idle_spans
    assert "4 iterations" in schedule.reason


def test_spans_too_short_for_any_chunk_have_no_interval() -> None:
    schedule = schedule_checkpoint([0.05, 0.05], 100, 1, LINK)
    assert not schedule.fits_idle_spans and schedule.interval_iterations is None
    assert [c.span_index for c in schedule.chunks] == [1]
    assert "block training" in schedule.reason


def test_chunks_never_straddle_two_copies() -> None:
    schedule = schedule_checkpoint([100.0], 70, 3, LINK, buffer_bytes=200, sub_buffers=4)
    assert [(c.copy, c.offset, c.size_bytes) for c in schedule.chunks] == [
        (0, 0, 50),
        (0, 50, 20),
        (1, 0, 50),
        (1, 50, 20),
        (2, 0, 50),
        (2, 50, 20),
    ]


def test_m1_sends_nothing() -> None:
    schedule = schedule_checkpoint([1.0], 10**9, 0, LINK)
    assert schedule.chunks == () and schedule.fits_idle_spans


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"spans": []}, "no idle spans", id="no spans"),
        pytest.param({"mu": 0.0}, "mu", id="mu of zero"),
        pytest.param({"mu": 1.5}, "mu", id="mu above one"),
        pytest.param(
            {"buffer_bytes": 2, "sub_buffers": 4},
            "sub-buffers",
            id="a buffer smaller than its sub-buffers",
        ),
        pytest.param({"checkpoint_bytes": -1}, "checkpoint_bytes", id="a negative checkpoint"),
    ],
)
def test_bad_schedules_raise(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"spans": [1.0], "checkpoint_bytes": 10, "copies": 1, "link": LINK}
    with pytest.raises(TrafficError, match=message):
        schedule_checkpoint(**(args | kwargs))


def test_links_need_bandwidth() -> None:
    with pytest.raises(TrafficError, match="bandwidth"):
        LinkModel(0.0, 0.0)


@settings(max_examples=80, deadline=None)
@given(
    spans=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=8),
    checkpoint=st.integers(0, 3000),
    copies=st.integers(0, 3),
    alpha=st.floats(0.0, 0.2),
    bandwidth=st.floats(10.0, 1000.0),
    mu=st.floats(0.1, 1.0),
    buffer=st.integers(8, 800),
    sub_buffers=st.integers(1, 4),
)
def test_schedule_invariants(spans, checkpoint, copies, alpha, bandwidth, mu, buffer, sub_buffers):
    link = LinkModel(alpha, bandwidth)
    schedule = schedule_checkpoint(spans, checkpoint, copies, link, mu, buffer, sub_buffers)
    limit = buffer // sub_buffers
    assert sum(c.size_bytes for c in schedule.chunks) == copies * checkpoint
    assert all(0 < c.size_bytes <= limit for c in schedule.chunks)
    assert [c.span_index for c in schedule.chunks] == sorted(c.span_index for c in schedule.chunks)
    used = span_seconds(schedule, link)
    last = len(spans) - 1
    for index, seconds in used.items():
        if index != last:
            assert seconds <= mu * spans[index] + 1e-9
    if schedule.fits_idle_spans:
        assert used.get(last, 0.0) <= mu * spans[last] + 1e-9
    else:
        k = schedule.interval_iterations
        assert k is None or k > 1
        if k is not None:
            assert schedule_checkpoint(
                spans * k, checkpoint, copies, link, mu, buffer, sub_buffers
            ).fits_idle_spans
