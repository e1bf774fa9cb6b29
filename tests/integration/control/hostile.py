"""Peers a job's author could run, as real TCP servers on loopback: each connection reads one
HTTP request and answers it with a behaviour (slowly, hugely, oddly shaped, or properly)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

# (connection, the request's path, the server answering)
Behaviour = Callable[[socket.socket, str, "Server"], None]
MiB = 1024 * 1024


class Server:
    """One listening socket on `host` (port 0: any free one); a thread per connection."""

    def __init__(self, behaviour: Behaviour, host: str = "127.0.0.1", port: int = 0) -> None:
        self.behaviour = behaviour
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.05)
        self.host, self.port = host, int(self._listener.getsockname()[1])
        self.paths: list[str] = []  # every request's path, in order
        self.sent = 0  # body bytes written (the big answers count them)
        self.active = self.most_active = 0  # connections being answered now, and at most
        self._lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            with conn:
                path = _read_request(conn)
                self.paths.append(path)
                self.behaviour(conn, path, self)
        except OSError:
            pass  # the client hung up: what its refusal looks like from here
        finally:
            with self._lock:
                self.active -= 1

    def close(self) -> None:
        self.stop.set()
        self._listener.close()


@contextmanager
def serving(behaviour: Behaviour, host: str = "127.0.0.1", port: int = 0) -> Iterator[Server]:
    server = Server(behaviour, host, port)
    try:
        yield server
    finally:
        server.close()


def _read_request(conn: socket.socket) -> str:
    """Read one request (head and Content-Length body); its path."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionResetError("the client hung up before its request")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                   if line.lower().startswith("content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return lines[0].split(" ")[1]


def _head(status: int = 200, **headers: object) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def _drip(conn: socket.socket, stop: threading.Event, interval: float, limit: float) -> None:
    """One byte every `interval` seconds, for `limit` seconds at most."""
    ends = time.monotonic() + limit
    while not stop.is_set() and time.monotonic() < ends:
        conn.sendall(b"a")
        time.sleep(interval)


def drip_head(interval: float = 0.05, limit: float = 20.0) -> Behaviour:
    """The status line, then a header one byte at a time: every read gets a byte in time."""
    def behaviour(conn: socket.socket, _: str, server: Server) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        _drip(conn, server.stop, interval, limit)
    return behaviour


def drip_body(interval: float = 0.05, limit: float = 20.0) -> Behaviour:
    """A whole head announcing 1000 bytes, then the body one byte at a time."""
    def behaviour(conn: socket.socket, _: str, server: Server) -> None:
        conn.sendall(_head(Content_Length=1000))
        _drip(conn, server.stop, interval, limit)
    return behaviour


def huge(total: int, framing: str) -> Behaviour:
    """`total` bytes of body, framed by Content-Length ("length"), by chunks ("chunked") or
    by the end of the connection ("close"); one reused block, so the server holds 1 MiB."""
    block = memoryview(b" " * MiB)

    def behaviour(conn: socket.socket, _: str, server: Server) -> None:
        if framing == "length":
            conn.sendall(_head(Content_Length=total))
        elif framing == "chunked":
            conn.sendall(_head(Transfer_Encoding="chunked"))
        else:
            conn.sendall(_head(Connection="close"))
        framed: list[bytes | memoryview] = (
            [f"{MiB:x}\r\n".encode(), block, b"\r\n"] if framing == "chunked" else [block])
        for _block in range(total // MiB):
            if server.stop.is_set():
                return
            for part in framed:
                conn.sendall(part)
            server.sent += MiB
    return behaviour


def answer(raw: bytes, status: int = 200) -> Behaviour:
    """One fixed answer, with its length."""
    def behaviour(conn: socket.socket, _: str, server: Server) -> None:
        conn.sendall(_head(status, Content_Length=len(raw)) + raw)
    return behaviour


def routes(answers: Mapping[str, bytes]) -> Behaviour:
    """A well-behaved peer: each path's answer, 404 for any other."""
    def behaviour(conn: socket.socket, path: str, server: Server) -> None:
        raw = answers.get(path)
        if raw is None:
            answer(b'{"error": "no such path"}', 404)(conn, path, server)
        else:
            answer(raw)(conn, path, server)
    return behaviour
