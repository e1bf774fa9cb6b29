"""SIGTERM and SIGINT (a timeout, Ctrl-C) end the demo through its teardown.

`SignalGuard` turns the first of them into `DemoInterrupted` in the main thread, so the
demo's `finally` blocks run. A signal inside `shielded()` (the teardown, the start of a
process whose handle must not be lost) is remembered instead of raised, so that work is never
cut in half; `raise_pending()` raises it afterwards. Signals after the first are remembered
only: a second Ctrl-C does not abort a teardown under way.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DemoInterrupted(BaseException):
    """The demo got SIGTERM or SIGINT; like KeyboardInterrupt, no `except Exception` stops it."""

    def __init__(self, signum: int, note: str = "") -> None:
        self.signum = signum
        self.note = note  # what became of the cluster: torn down, or left running (--keep)
        super().__init__(f"stopped by {signal.Signals(signum).name}"
                         + (f"; {note}" if note else ""))

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process the signal ended (130, 143)."""
        return 128 + self.signum


class SignalGuard:
    def __init__(self) -> None:
        self.received: int | None = None
        self.raised = False
        self._shield = 0
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def install(self) -> SignalGuard:
        """Take over SIGTERM and SIGINT (only the main thread can; elsewhere nothing)."""
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:
            return  # already stopping: the teardown under way finishes
        self.received = signum
        if not self._shield:
            self.raised = True
            raise DemoInterrupted(signum)

    @contextmanager
    def shielded(self, raise_after: bool = True) -> Iterator[None]:
        """Defer a signal to the end of the block (raised there when `raise_after`)."""
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1
        if raise_after and not self._shield and self.received is not None and not self.raised:
            self.raised = True
            raise DemoInterrupted(self.received)

    def raise_pending(self, note: str = "") -> None:
        """Raise DemoInterrupted (with `note`) if a signal came at all."""
        if self.received is not None:
            self.raised = True
            raise DemoInterrupted(self.received, note)
