"""Connection gates: how many connections one listener keeps open, per source address and in
total, and the log of what it refused.

The total is a lever as much as a guard: a few addresses that fill it keep everyone else out.
So the addresses a listener knows (`trusted`: a job's own peers) are held to their per-address
limit only and never count toward the total, which only the others share."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)
REFUSAL_FOLD_S = 10.0


class Limits(Protocol):
    @property
    def max_connections(self) -> int: ...  # open in total from addresses not trusted

    @property
    def max_connections_per_host(self) -> int: ...  # open from one address


@dataclass(frozen=True)
class ConnectionLimits:
    """Limits of a listener with no other settings (the sidecar's ServerLimits carries its
    own, with its timeouts)."""

    max_connections: int  # open in total from addresses not trusted
    max_connections_per_host: int  # open from one address


def host_of(peer: str) -> str:
    """The host of a host:port address (IPv6 too: the port is after the last colon)."""
    return peer.rsplit(":", 1)[0]


def address_of(addr: Any) -> str:
    """host:port of a socket address (IPv4 or IPv6), for logs."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)


class _Uncounted:
    """A counter for a listener whose refusals nobody counts."""

    def inc(self) -> None:
        pass


UNCOUNTED = _Uncounted()


def nobody_trusted(host: str) -> bool:
    return False


class ConnectionGate:
    """Open connections of one listener: each address within `max_connections_per_host`, the
    addresses not `trusted` within `max_connections` together. Thread-safe (the launcher's
    server admits on its threads)."""

    def __init__(self, limits: Limits, env_prefix: str | None = None,
                 trusted: Callable[[str], bool] = nobody_trusted) -> None:
        self.limits = limits
        self._prefix = env_prefix  # the settings' environment names, where there are any
        self._trusted = trusted
        self._lock = threading.Lock()
        self.open = 0  # every connection, trusted or not
        self.untrusted = 0
        self._per_host: Tally[str] = Tally()
        self._counted: dict[str, bool] = {}  # host -> counted toward the total

    def admit(self, host: str) -> str | None:
        """Counts the connection in, or returns why it is refused."""
        with self._lock:
            if self._per_host[host] >= self.limits.max_connections_per_host:
                return (f"{self._per_host[host]} connections open from {host}, the limit "
                        f"({self._setting('_PER_HOST', self.limits.max_connections_per_host)})")
            counted = self._counted.get(host)
            if counted is None:
                counted = not self._trusted(host)
            if counted and self.untrusted >= self.limits.max_connections:
                return (f"{self.untrusted} connections open from addresses outside the job, the "
                        f"limit ({self._setting('', self.limits.max_connections)})")
            self._counted[host] = counted  # a host keeps its standing while connected
            self._per_host[host] += 1
            self.open += 1
            self.untrusted += counted
            return None

    def _setting(self, suffix: str, value: int) -> str:
        return f"{self._prefix}_MAX_CONNECTIONS{suffix}={value}" if self._prefix else str(value)

    def release(self, host: str) -> None:
        with self._lock:
            self.open -= 1
            self.untrusted -= self._counted.get(host, True)
            self._per_host[host] -= 1
            if self._per_host[host] <= 0:
                del self._per_host[host]
                self._counted.pop(host, None)


class RefusalLog:
    """Logs each refused connection or call once, with the peer's address and the reason
    (never what it sent: it may hold a token). A flood is folded: after a line for a host
    and reason, more of the same within REFUSAL_FOLD_S are counted and reported as a count in
    the next line for them (or at stop). Every refusal is counted in `counter` at once."""

    def __init__(self, listener: str, counter: Any) -> None:  # a prometheus Counter
        self.listener = listener
        self._counter = counter
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # -> (logged at, folded)

    def refuse(self, peer: str, reason: str) -> None:
        self._counter.inc()
        key = (host_of(peer), reason)
        now = time.monotonic()
        with self._lock:
            logged_at, folded = self._last.get(key, (-math.inf, 0))
            if now - logged_at < REFUSAL_FOLD_S:
                self._last[key] = (logged_at, folded + 1)
                return
            self._last[key] = (now, 0)
            if len(self._last) > 1024:  # many hosts: keep only those inside their window
                self._flush(older_than=now - REFUSAL_FOLD_S)
        more = f" (and {folded} more from {key[0]} since the last line)" if folded else ""
        log.warning("%s: refused %s: %s%s", self.listener, peer, reason, more)

    def flush(self) -> None:
        """Log the folded counts and forget them."""
        with self._lock:
            self._flush(older_than=math.inf)

    def _flush(self, older_than: float) -> None:
        for key, (logged_at, folded) in list(self._last.items()):
            if logged_at < older_than:
                if folded:
                    log.warning("%s: refused %d more from %s: %s", self.listener, folded, *key)
                del self._last[key]
