"""Where each replication chunk goes in time: immediately, or in the training's idle spans.

The trainer profiles a few iterations without checkpoints and records its communication
operations; from that profile the pure scheduler (gemini.domain.traffic, GEMINI Algorithm 2)
assigns chunks to idle spans. Here the schedule becomes per-peer send plans with delays
relative to the notification that a version is ready (the start of the next iteration).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemini.domain.traffic import (
    IterationTimeline,
    LinkModel,
    TrafficError,
    TrafficSchedule,
    idle_spans,
    schedule_checkpoint,
)
from gemini_sidecar.peer_client import PlannedChunk, even_plan

MIN_SPAN_S = 0.001


@dataclass(frozen=True)
class Profile:
    """Profiled iterations: length and communication ops (start, end) relative to its start."""

    iterations: tuple[IterationTimeline, ...]


@dataclass(frozen=True)
class Plans:
    per_copy: tuple[tuple[PlannedChunk, ...], ...]  # one plan per peer, in send_to order
    schedule: TrafficSchedule | None  # None in immediate mode or without a profile


def profile_from_json(doc: Any) -> Profile:
    """`{"iterations": [{"length": s, "ops": [[start, end], ...]}, ...]}`."""
    try:
        items = doc["iterations"]
        timelines = tuple(
            IterationTimeline(
                float(it["length"]), tuple((float(a), float(b)) for a, b in it["ops"])
            )
            for it in items
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            'a profile is {"iterations": [{"length": seconds, "ops": [[start, end], ...]}]}'
        ) from err
    if not timelines:
        raise ValueError("the profile has no iterations")
    return Profile(timelines)


def profile_path(shm_dir: Path, rank: int, job: str = "") -> Path:
    prefix = f"gemini-{job}-" if job else "gemini-"
    return shm_dir / f"{prefix}rank{rank}.profile.json"


def load_profile(path: Path) -> Profile | None:
    """The profile the trainer wrote, or None if there is none (yet) or it is unreadable."""
    try:
        return profile_from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def plan(
    length: int, copies: int, chunk_bytes: int, profile: Profile | None, link: LinkModel,
    mu: float = 0.7,
) -> Plans:
    """Send plans for `copies` peers of a `length`-byte version."""
    if profile is None or copies == 0 or length == 0:
        return Plans(tuple(tuple(even_plan(length, chunk_bytes)) for _ in range(copies)), None)
    try:
        spans = idle_spans(profile.iterations, MIN_SPAN_S)
        schedule = schedule_checkpoint(
            spans, length, copies, link, mu, buffer_bytes=4 * chunk_bytes, sub_buffers=4
        )
    except TrafficError:
        return Plans(tuple(tuple(even_plan(length, chunk_bytes)) for _ in range(copies)), None)
    per_copy: list[list[tuple[int, float]]] = [[] for _ in range(copies)]
    for chunk in schedule.chunks:
        per_copy[chunk.copy].append((chunk.offset, spans[chunk.span_index].start))
    return Plans(tuple(_aligned(starts, length) for starts in per_copy), schedule)


def _aligned(starts: list[tuple[int, float]], length: int) -> tuple[PlannedChunk, ...]:
    """Chunks from (offset, delay) starts, boundaries rounded down to multiples of 8 (the
    replica store takes chunks at 8-byte-aligned offsets only)."""
    bounds = sorted({(off // 8) * 8: delay for off, delay in reversed(starts)}.items())
    out = []
    for i, (off, delay) in enumerate(bounds):
        end = bounds[i + 1][0] if i + 1 < len(bounds) else length
        if end > off:
            out.append(PlannedChunk(off, end - off, delay))
    return tuple(out)
