"""The process's file descriptors: a limit raised at start (a server that holds connections
for others must not run out of descriptors for its own calls at the default soft limit of
1024), and asyncio's accept errors when they run out logged once per run, not every second."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

log = logging.getLogger(__name__)
# Descriptors asked for (up to the hard limit): each peer connection of a sidecar takes two.
WANTED_FDS = 65536
ACCEPT_ERROR_QUIET_S = 60.0


def raise_fd_limit(wanted: int = WANTED_FDS) -> int:
    """Raise the soft RLIMIT_NOFILE towards `wanted` (the hard limit at most); returns the
    soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return wanted if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as err:  # a sandbox that refuses: keep what there is
        log.warning("cannot raise the file descriptor limit from %d to %d: %s",
                    soft, target, err)
        return soft
    return target


def log_accept_errors_once(loop: asyncio.AbstractEventLoop, name: str) -> None:
    """asyncio's servers retry a failed accept (out of file descriptors) every second and
    report each failure to the loop: log the first of a run only (as `name`), instead of a
    line a second while it lasts. Other reports go to the handler there was before."""
    last_logged = -ACCEPT_ERROR_QUIET_S
    before = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal last_logged
        if context.get("message") != "socket.accept() out of system resource":
            if before is not None:
                before(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        if time.monotonic() - last_logged >= ACCEPT_ERROR_QUIET_S:
            last_logged = time.monotonic()
            log.error("%s: cannot accept connections (%s); retrying every second, logged "
                      "again after %g s at the earliest", name, context.get("exception"),
                      ACCEPT_ERROR_QUIET_S)

    loop.set_exception_handler(handler)
