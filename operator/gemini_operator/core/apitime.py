"""Timestamps as the Kubernetes API writes them: RFC 3339, UTC, whole seconds."""

from __future__ import annotations

from datetime import UTC, datetime

FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def api_time(moment: datetime) -> str:
    """`moment` as the API writes times (a naive moment is taken as UTC already)."""
    return (moment.astimezone(UTC) if moment.tzinfo else moment).strftime(FORMAT)


def parse_api_time(text: object) -> datetime | None:
    """An API time (fractions and offsets accepted), in UTC; None when absent or malformed."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None
