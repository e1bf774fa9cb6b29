"""The launcher's line to a training process that can restart in place (stdlib only).

A training process run by ``gemini_trainer.run`` connects to the Unix socket named by
GEMINI_INPROCESS_SOCKET (the launcher listens there) and says who it is. When its training
function fails (a peer died and the collective broke, or the launcher asked it to stop with
SIGUSR1) it tears its distributed state down and *parks*: it tells the launcher and waits.
A process asked with SIGUSR1 says "parking" from the signal handler, before its stack unwinds
(seconds on a busy machine), so the launcher can tell it from one that cannot run Python.
The launcher answers the operator's next POST /restart by sending the new epoch's environment
down the line instead of starting a process: torch, the model code and the imports stay
loaded, and the restart costs a rendezvous and a restore from local memory.

Messages are one JSON object per line:
    process -> launcher   {"hello": pid}  {"parking": pid}  {"parked": pid, "error": "..."}
                          {"resumed": epoch}
    launcher -> process   {"restart": epoch, "env": {...}}
A line over MAX_LINE bytes ends the connection (the process then restarts the usual way).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOCKET_ENV = "GEMINI_INPROCESS_SOCKET"
ENABLE_ENV = "GEMINI_LAUNCHER_IN_PROCESS"
MAX_LINE = 256 * 1024  # an environment of a few hundred variables fits many times
ERROR_CHARS = 2000  # of the failure's text, kept for the operator's message


def enabled(env: Mapping[str, str]) -> bool:
    """On unless GEMINI_LAUNCHER_IN_PROCESS says 0/false/no/off."""
    return env.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


class _Lines:
    """Reads newline-ended JSON objects from a stream socket (None at the end or on junk)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def next(self) -> dict[str, Any] | None:
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE:
                return None
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                return None
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None


class ProcessLink:
    """The training process's end: say hello, report parking, wait for the next epoch."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lines = _Lines(sock)

    @classmethod
    def connect(cls, env: Mapping[str, str] | None = None) -> ProcessLink | None:
        """The line to the launcher, or None when there is none (not under a launcher that
        offers in-process restarts): the caller then fails the usual way."""
        env = os.environ if env is None else env
        path = env.get(SOCKET_ENV)
        if not path:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            _send(sock, {"hello": os.getpid()})
        except OSError as err:
            log.warning("no in-process restarts: cannot reach the launcher at %s (%s)", path, err)
            sock.close()
            return None
        return cls(sock)

    def parking(self) -> None:
        """Say the SIGUSR1 arrived and the process is on its way to park."""
        with contextlib.suppress(OSError):
            _send(self._sock, {"parking": os.getpid()})

    def park(self, error: str) -> bool:
        """Tell the launcher this process failed and will wait for the next epoch. Sent
        before the failed attempt is torn down (which can take seconds on a busy machine),
        so a launcher that asked with SIGUSR1 knows at once; False when the line is gone."""
        try:
            _send(self._sock, {"parked": os.getpid(), "error": error[-ERROR_CHARS:]})
        except OSError:
            return False
        return True

    def next_epoch(self) -> dict[str, str] | None:
        """Block until the launcher sends the next epoch's environment (returned), or None
        when it ends the line."""
        message = self._lines.next()
        if message is None or not isinstance(message.get("env"), dict):
            return None
        env = message["env"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            return None
        return dict(env)

    def resumed(self, epoch: int) -> None:
        with contextlib.suppress(OSError):
            _send(self._sock, {"resumed": epoch})

    def close(self) -> None:
        self._sock.close()


class LinkServer:
    """The launcher's end: accepts the training processes' lines and keeps the latest per pid.

    ``on_parked(pid, error)`` runs on the line's reader thread when a process parks,
    ``on_parking(pid)`` when one asked to park says it is on its way."""

    def __init__(self, path: Path, on_parked: Callable[[int, str], None],
                 on_parking: Callable[[int], None]) -> None:
        self.path = path
        self._on_parked = on_parked
        self._on_parking = on_parking
        self._lock = threading.Lock()
        self._links: dict[int, socket.socket] = {}
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)  # the pod's own user only
        self._listener.listen(8)
        threading.Thread(target=self._accept, name="inprocess-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="inprocess-link",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lines = _Lines(conn)
        hello = lines.next()
        pid = hello.get("hello") if hello else None
        if not isinstance(pid, int):
            conn.close()
            return
        with self._lock:
            old = self._links.pop(pid, None)
            self._links[pid] = conn
        if old is not None:
            old.close()
        while (message := lines.next()) is not None:
            if "parked" in message:
                self._on_parked(pid, str(message.get("error", ""))[:ERROR_CHARS])
            elif "parking" in message:
                self._on_parking(pid)
        with self._lock:
            if self._links.get(pid) is conn:
                del self._links[pid]
        conn.close()

    def has(self, pid: int) -> bool:
        with self._lock:
            return pid in self._links

    def order(self, pid: int, epoch: int, env: Mapping[str, str]) -> bool:
        """Send the next epoch to the parked process `pid`; False when its line is gone."""
        with self._lock:
            conn = self._links.get(pid)
        if conn is None:
            return False
        try:
            _send(conn, {"restart": epoch, "env": dict(env)})
        except OSError:
            return False
        return True

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for conn in links:
            conn.close()
        self.path.unlink(missing_ok=True)
