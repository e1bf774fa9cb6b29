"""Fair shares of a bounded set of workers among namespaces (tenants): the operator's polls
and reconciles take keys from here instead of first come, first served, so one namespace's
many or slow jobs cannot keep another's from its turn.

Waiting keys are grouped by namespace and the groups served in turn (round robin), and no
namespace runs more than `per_group` keys at once: with `per_group` below the workers, a
slot stays free for another namespace however busy one is. A key is waiting at most once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
G = TypeVar("G", bound=Hashable)


class FairQueue(Generic[G, K]):
    def __init__(self, per_group: int) -> None:
        if per_group < 1:
            raise ValueError("per_group must be at least 1")
        self.per_group = per_group
        self._waiting: OrderedDict[G, deque[K]] = OrderedDict()  # in turn order
        self._queued: set[K] = set()
        self._running: dict[G, int] = {}

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, key: object) -> bool:
        return key in self._queued

    def add(self, group: G, key: K) -> bool:
        """Queue `key` (False: it already waits)."""
        if key in self._queued:
            return False
        self._queued.add(key)
        self._waiting.setdefault(group, deque()).append(key)
        return True

    def take(self) -> tuple[G, K] | None:
        """The next key to run, from the first group in turn that may run one more; that
        group goes to the back of the turn. None: nothing may run now."""
        for group in self._groups_in_turn():
            keys = self._waiting[group]
            key = keys.popleft()
            self._queued.discard(key)
            if keys:
                self._waiting.move_to_end(group)
            else:
                del self._waiting[group]
            self._running[group] = self._running.get(group, 0) + 1
            return group, key
        return None

    def done(self, group: G) -> None:
        """A key of `group` taken earlier has finished."""
        left = self._running.get(group, 0) - 1
        if left > 0:
            self._running[group] = left
        else:
            self._running.pop(group, None)

    def running(self, group: G) -> int:
        return self._running.get(group, 0)

    def _groups_in_turn(self) -> Iterator[G]:
        for group in list(self._waiting):
            if self._running.get(group, 0) < self.per_group:
                yield group
