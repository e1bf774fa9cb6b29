"""A scripted HTTP server on loopback for the client tests: it answers each path with what a
test set, and records every request it got (method, path, headers, body, query)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    query: str = ""  # after the path's "?"


@dataclass
class Scripted:
    """path -> (status, raw body) for every answer; what came in, in order."""

    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)

    def answer(self, path: str, doc: Any, status: int = 200) -> None:
        self.answers[path] = (status, json.dumps(doc).encode())

    def answer_raw(self, path: str, raw: bytes, status: int = 200) -> None:
        self.answers[path] = (status, raw)

    def bodies(self, path: str) -> list[Any]:
        return [json.loads(s.body) if s.body else None for s in self.seen if s.path == path]


def serve(script: Scripted) -> tuple[ThreadingHTTPServer, int]:
    """Start the server on 127.0.0.1 (a free port) in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path, _, query = self.path.partition("?")
            script.seen.append(Seen(self.command, path, dict(self.headers.items()), body, query))
            status, raw = script.answers.get(path, (404, b'{"error": "no such path"}'))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = _handle
        do_POST = _handle

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server, int(server.server_address[1])
