"""Arrival times of Kubernetes watch events, for benches and tests that time the operator as
the API shows it (from one event in a watch to another), not through their own requests."""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import watch


class Watcher:
    """Monotonic arrival times of a watch's events (type and object), recorded in a thread.
    A watch without a resourceVersion first replays the objects as they are (ADDED), so any
    event recorded means the watch runs."""

    def __init__(self, list_fn: Any, *args: Any, **kwargs: Any) -> None:
        self.events: list[tuple[float, str, Any]] = []
        self._lock = threading.Lock()
        self._watch = watch.Watch()
        threading.Thread(target=self._run, args=(list_fn, args, kwargs), daemon=True).start()

    def _run(self, list_fn: Any, args: Any, kwargs: Any) -> None:
        try:
            for event in self._watch.stream(list_fn, *args, **kwargs):
                with self._lock:
                    self.events.append((time.monotonic(), event["type"], event["object"]))
        except Exception:  # the stream breaks when stopped; a dead watcher just sees no more
            return

    def first(self, test: Any, after: float, types: tuple[str, ...] | None = None
              ) -> float | None:
        """When the first event at or after `after` (of `types`, if given) satisfied `test`."""
        with self._lock:
            return next((t for t, kind, obj in self.events
                         if t >= after and (types is None or kind in types) and test(obj)),
                        None)

    def stop(self) -> None:
        self._watch.stop()
