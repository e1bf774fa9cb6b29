"""Checkpoint traffic scheduling (GEMINI's Algorithm 2, with the printed errata corrected).

Checkpoint copies share the network with the training's own communication, so they are sent
in chunks inside the idle spans between the training's communication operations:

1. `idle_spans` derives the spans from profiled timelines (per span, the minimum over the
   profiled iterations; spans shorter than a threshold are dropped).
2. `schedule_checkpoint` splits the (m-1) copies into chunks of at most R/p bytes (R the
   reserved GPU buffer, p its sub-buffers, so one sub-buffer can be copied out while another
   receives) and assigns them greedily: a span of length t has budget mu * t, a chunk of s
   bytes costs alpha + s/B, the last span is unbounded. Errata applied: the budget is reduced
   by f(size) (not f(remaining)), and the loop stops once the computed size is 0.

Beyond the paper: chunks never straddle two copies (each copy goes to a different peer), and
when the checkpoint does not fit one iteration's idle spans, the schedule says the smallest
interval (every k iterations) whose spans do fit it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1024 * 1024
DEFAULT_BUFFER_BYTES = 128 * MIB
# Beyond this many spans the interval is estimated from per-span capacity, not simulated.
MAX_SIMULATED_SPANS = 1_000_000


class TrafficError(ValueError):
    """Inputs that cannot be scheduled (no spans, non-positive bandwidth, mu outside (0, 1])."""


@dataclass(frozen=True)
class IterationTimeline:
    """One profiled iteration: its length and its communication operations as (start, end)
    seconds relative to the iteration's start (in any order; overlaps are merged)."""

    length: float
    ops: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class IdleSpan:
    """A window with no training communication. `gap` numbers it among the iteration's gaps:
    gap g starts when the g-th (merged) communication operation ends (gap 0: before the first).
    `start` and `length` are in seconds, conservative over the profiled iterations."""

    gap: int
    start: float
    length: float


@dataclass(frozen=True)
class LinkModel:
    """Transfer time of one chunk: alpha + size / bandwidth (the paper's f(s))."""

    alpha_seconds: float
    bandwidth_bytes_per_second: float

    def __post_init__(self) -> None:
        if self.alpha_seconds < 0 or self.bandwidth_bytes_per_second <= 0:
            raise TrafficError(
                "the link needs alpha >= 0 and a positive bandwidth, got "
                f"alpha={self.alpha_seconds}, B={self.bandwidth_bytes_per_second}"
            )

    def transfer_seconds(self, size_bytes: int) -> float:
        return self.alpha_seconds + size_bytes / self.bandwidth_bytes_per_second

    def bytes_within(self, seconds: float) -> int:
        """The largest chunk that transfers within `seconds` (0 if not even alpha fits)."""
        return max(0, math.floor((seconds - self.alpha_seconds) * self.bandwidth_bytes_per_second))


@dataclass(frozen=True, slots=True)
class Chunk:
    """Send `size_bytes` of copy `copy` (0..m-2, one per peer), from byte `offset` of the
    checkpoint, in span `span_index` (an index into the spans given to the scheduler)."""

    span_index: int
    size_bytes: int
    copy: int = 0
    offset: int = 0


@dataclass(frozen=True)
class TrafficSchedule:
    """The chunks in sending order; whether they all fit the idle spans within their budgets
    (the last span included); if not, the smallest checkpoint interval that fits (None when
    no interval does: the spans cannot carry even one byte)."""

    chunks: tuple[Chunk, ...]
    fits_idle_spans: bool
    interval_iterations: int | None
    max_chunk_bytes: int
    reason: str


def idle_spans(
    iterations: Sequence[IterationTimeline | Sequence[tuple[float, float]]],
    min_span: float,
    iteration_lengths: Sequence[float] | None = None,
) -> tuple[IdleSpan, ...]:
    """The idle spans common to all profiled iterations, in time order.

    Each iteration is an IterationTimeline, or just its ops as (start, end) pairs, in which case
    the gap after the last op is only known if `iteration_lengths` gives each iteration's
    length. Per gap index, the span is the shortest seen (and starts at the latest start seen);
    iterations with fewer gaps limit the count. Spans shorter than `min_span` are dropped, so
    `gap` (not the position in the result) identifies a span in the timeline.
    """
    timelines = _timelines(iterations, iteration_lengths)
    if not timelines:
        raise TrafficError("profile at least one iteration to find idle spans")
    per_iteration = [_gaps(t) for t in timelines]
    count = min(len(g) for g in per_iteration)
    spans = []
    for gap in range(count):
        start = max(g[gap][0] for g in per_iteration)
        length = min(g[gap][1] for g in per_iteration)
        if length >= min_span and length > 0:
            spans.append(IdleSpan(gap, start, length))
    return tuple(spans)


def schedule_checkpoint(
    spans: Sequence[IdleSpan | float],
    checkpoint_bytes: int,
    copies: int,
    link: LinkModel,
    mu: float = 0.7,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    sub_buffers: int = 4,
) -> TrafficSchedule:
    """Assign `copies` (m-1) copies of a `checkpoint_bytes` checkpoint to the idle spans.

    `spans` are IdleSpans or plain lengths in seconds. Chunks are at most
    buffer_bytes // sub_buffers. The last span is unbounded: whatever does not fit earlier is
    sent there, and `fits_idle_spans` says whether that stayed within its budget too.
    """
    lengths = _check_schedule(spans, checkpoint_bytes, copies, mu, buffer_bytes, sub_buffers)
    max_chunk = buffer_bytes // sub_buffers
    chunks, _ = _greedy(lengths, checkpoint_bytes, copies, link, mu, max_chunk, last_unbounded=True)
    used = sum(
        link.transfer_seconds(c.size_bytes) for c in chunks if c.span_index == len(lengths) - 1
    )
    fits = used <= mu * lengths[-1] + 1e-12 or not chunks
    interval = (
        1 if fits else _smallest_interval(lengths, checkpoint_bytes, copies, link, mu, max_chunk)
    )
    return TrafficSchedule(
        tuple(chunks), fits, interval, max_chunk, _reason(fits, interval, checkpoint_bytes, copies)
    )


def span_seconds(schedule: TrafficSchedule, link: LinkModel) -> dict[int, float]:
    """Transfer time the schedule puts into each span (for checking budgets)."""
    used: dict[int, float] = {}
    for chunk in schedule.chunks:
        used[chunk.span_index] = used.get(chunk.span_index, 0.0) + link.transfer_seconds(
            chunk.size_bytes
        )
    return used


def _timelines(
    iterations: Sequence[IterationTimeline | Sequence[tuple[float, float]]],
    lengths: Sequence[float] | None,
) -> list[IterationTimeline]:
    if lengths is not None and len(lengths) != len(iterations):
        raise TrafficError(f"got {len(lengths)} iteration lengths for {len(iterations)} iterations")
    timelines = []
    for i, item in enumerate(iterations):
        if isinstance(item, IterationTimeline):
            timelines.append(item)
        else:
            ops = tuple((float(s), float(e)) for s, e in item)
            end = lengths[i] if lengths is not None else max((e for _, e in ops), default=0.0)
            timelines.append(IterationTimeline(end, ops))
    return timelines


def _gaps(timeline: IterationTimeline) -> list[tuple[float, float]]:
    """(start, length) of gap g for each g: gap 0 before the first busy interval, gap g after
    the g-th one, the last up to the end of the iteration. Overlapping ops merge into one
    busy interval; gaps may have length 0."""
    busy: list[list[float]] = []
    for start, end in sorted(timeline.ops):
        if end < start or start < 0:
            raise TrafficError(f"an op must satisfy 0 <= start <= end, got ({start}, {end})")
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    gaps = []
    cursor = 0.0
    for start, end in busy:
        gaps.append((cursor, start - cursor))
        cursor = end
    gaps.append((cursor, max(0.0, timeline.length - cursor)))
    return gaps


def _check_schedule(
    spans: Sequence[IdleSpan | float],
    checkpoint_bytes: int,
    copies: int,
    mu: float,
    buffer_bytes: int,
    sub_buffers: int,
) -> list[float]:
    if not spans:
        raise TrafficError("no idle spans to schedule into; profile the training first")
    if checkpoint_bytes < 0 or copies < 0:
        raise TrafficError(
            f"need checkpoint_bytes >= 0 and copies >= 0, got {checkpoint_bytes}, {copies}"
        )
    if not 0 < mu <= 1:
        raise TrafficError(f"mu must be in (0, 1], got {mu}")
    if sub_buffers < 1 or buffer_bytes < sub_buffers:
        raise TrafficError(
            f"the buffer ({buffer_bytes} bytes) must split into {sub_buffers} non-empty sub-buffers"
        )
    lengths = [s.length if isinstance(s, IdleSpan) else float(s) for s in spans]
    if any(length < 0 for length in lengths):
        raise TrafficError("span lengths must be non-negative")
    return lengths


def _greedy(
    spans: Sequence[float],
    checkpoint_bytes: int,
    copies: int,
    link: LinkModel,
    mu: float,
    max_chunk: int,
    last_unbounded: bool,
) -> tuple[list[Chunk], int]:
    """Algorithm 2 (corrected). Returns the chunks and the bytes left unsent."""
    copy, offset = 0, 0
    remaining = copies * checkpoint_bytes
    chunks: list[Chunk] = []
    last = len(spans) - 1
    for index, length in enumerate(spans):
        budget = mu * length
        while remaining:
            room = checkpoint_bytes - offset  # chunks stay inside one copy
            size = min(room, max_chunk)
            if not (last_unbounded and index == last):
                size = min(size, link.bytes_within(budget))
            if size <= 0:
                break
            chunks.append(Chunk(index, size, copy, offset))
            budget -= link.transfer_seconds(size)
            remaining -= size
            offset += size
            if offset == checkpoint_bytes:
                copy, offset = copy + 1, 0
        if not remaining:
            break
    return chunks, remaining


def _span_capacity(length: float, link: LinkModel, mu: float, max_chunk: int) -> int:
    """Bytes the greedy loop fits into one span when data is plentiful."""
    budget, total = mu * length, 0
    while (size := min(max_chunk, link.bytes_within(budget))) > 0:
        total += size
        budget -= link.transfer_seconds(size)
    return total


def _smallest_interval(
    lengths: Sequence[float],
    checkpoint_bytes: int,
    copies: int,
    link: LinkModel,
    mu: float,
    max_chunk: int,
) -> int | None:
    per_iteration = sum(_span_capacity(t, link, mu, max_chunk) for t in lengths)
    if per_iteration == 0:
        return None
    k = max(1, math.ceil(copies * checkpoint_bytes / per_iteration))
    # Copy boundaries can cost a partial chunk per copy, so the estimate may fall just short:
    # verify by scheduling over k iterations' spans, unless that is too many to simulate.
    while k * len(lengths) <= MAX_SIMULATED_SPANS:
        _, left = _greedy(
            list(lengths) * k, checkpoint_bytes, copies, link, mu, max_chunk, last_unbounded=False
        )
        if not left:
            return k
        k += max(1, math.ceil(left / per_iteration))
    return k + copies  # at most one partly used span per copy boundary


def _reason(fits: bool, interval: int | None, checkpoint_bytes: int, copies: int) -> str:
    total = f"{copies} copies of {checkpoint_bytes} bytes"
    if fits:
        return f"{total} fit the idle spans of one iteration: checkpoint every iteration"
    if interval is None:
        return (
            f"{total} cannot use the idle spans (too short for even one chunk); they block training"
        )
    return f"{total} exceed one iteration's idle spans; spread over {interval} iterations they fit"
