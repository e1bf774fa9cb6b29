"""The launcher's HTTP API (gemini.control's launcher paths): routes, request reading, the
signature check, in front of the supervisor (gemini_trainer.supervisor). See
gemini_trainer.launcher for what each call does and who may make it."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gemini.control import auth, client, messages, paths, strict
from gemini.control import verifier as checks
from gemini.control.signing import Caller, Signed, audience_of
from gemini.control.verifier import RequestVerifier
from gemini.serving.gate import (
    UNCOUNTED,
    ConnectionGate,
    ConnectionLimits,
    RefusalLog,
    address_of,
    host_of,
)
from gemini_trainer import launcher_metrics
from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launch_state import LauncherError, RestartConflict, RestartRequest
from gemini_trainer.supervisor import Supervisor

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
REQUEST_TIMEOUT_S = 10.0  # a request's headers and body must arrive within this
WRITE_TIMEOUT_S = 10.0  # an answer the client does not read is dropped after this


class BodyTooLarge(LauncherError):
    """A request body over MAX_BODY (413)."""


def status_of(err: LauncherError) -> HTTPStatus:
    """The HTTP status a refusal is answered with."""
    if isinstance(err, RestartConflict):
        return HTTPStatus.CONFLICT
    if isinstance(err, BodyTooLarge):
        return HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    return HTTPStatus.BAD_REQUEST


def admitted(config: LauncherConfig, verifier: RequestVerifier, header: str | None,
             method: str, target: str, arrived: str, peer_host: str) -> Signed | None:
    """A call's checked signature (None: refuse it). The job's signature may read (GET);
    restarts and stops need the operator's once the pod has its public key
    (gemini.control.verifier.admitted)."""
    if not config.token:  # only with insecure_local on loopback (launch_config.check_token)
        return Signed(Caller.OPERATOR, None)
    given = (header or "").encode("utf-8", "surrogateescape")
    return checks.admitted(verifier, given, method, target, arrived, peer_host,
                         job_token_allowed=method == "GET")


def read_body(rfile: io.BufferedIOBase, content_length: str | None,
              signed: Signed | None = None) -> object:
    """A request's JSON object (an empty body reads as {}), parsed as strictly as the control
    client parses answers; LauncherError when it is too large, not the body `signed` covers,
    or not a JSON object."""
    length = int(content_length or 0)
    if length > MAX_BODY:
        raise BodyTooLarge("request body too large")
    raw = rfile.read(length) if length else b""
    if signed is not None and not signed.body_matches(raw):
        raise LauncherError("the body is not the one signed")
    try:
        body = strict.parse_json(raw or b"{}")
    except ValueError as err:
        raise LauncherError(f"body is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise LauncherError("body must be a JSON object")
    return body


# Connections to the launcher's API (a thread each, REQUEST_TIMEOUT_S at most): the operator's
# calls, Prometheus, the kubelet.
LAUNCHER_LIMITS = ConnectionLimits(256, 32)


class _GatedServer(ThreadingHTTPServer):
    """A thread per connection, admitted by a connection gate (gemini.serving.gate) first: a
    connection over the limits is closed at once and logged, never given a thread."""

    daemon_threads = True
    # a flood queued in the kernel instead of dropped SYNs (1 s retransmits for the operator)
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 limits: ConnectionLimits) -> None:
        super().__init__(address, handler)
        self.gate = ConnectionGate(limits)
        self.refusals = RefusalLog("launcher API", UNCOUNTED)
        self._hosts: dict[Any, str] = {}  # admitted connection -> its host
        self._hosts_lock = threading.Lock()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        peer = address_of(client_address)
        refusal = self.gate.admit(host_of(peer))
        if refusal is not None:
            self.refusals.refuse(peer, refusal)
            return False
        with self._hosts_lock:
            self._hosts[request] = host_of(peer)
        return True

    def shutdown_request(self, request: Any) -> None:
        """Every connection ends here, admitted or not."""
        with self._hosts_lock:
            host = self._hosts.pop(request, None)
        super().shutdown_request(request)
        if host is not None:
            self.gate.release(host)


class LauncherServer:
    """The API's listening server, bound at construction (OSError: the address is taken);
    ``start`` serves it on a thread of its own, ``close`` ends it."""

    def __init__(self, supervisor: Supervisor, config: LauncherConfig,
                 limits: ConnectionLimits = LAUNCHER_LIMITS) -> None:
        handler = _handler_for(supervisor, config)
        self._server = _GatedServer((config.host, config.port), handler, limits)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        threading.Thread(
            target=self._server.serve_forever, name="launcher-api", daemon=True
        ).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler_for(supervisor: Supervisor, config: LauncherConfig
                 ) -> type[BaseHTTPRequestHandler]:
    verifier = RequestVerifier(config.token.encode(), config.control_public_key)

    class Handler(BaseHTTPRequestHandler):
        server_version = "gemini-launcher"
        signed: Signed | None = None

        def setup(self) -> None:
            # One request per connection (HTTP/1.0): its deadline covers the request line,
            # the headers and the body, read as the control client reads answers;
            # BaseHTTPRequestHandler closes the connection on TimeoutError.
            super().setup()
            self.rfile.close()
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            self.rfile = client.DeadlineSocket(self.connection, deadline).makefile("rb")

        def _send(self, status: HTTPStatus, content_type: str, data: bytes) -> None:
            self.connection.settimeout(WRITE_TIMEOUT_S)  # not what was left of the read's
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _reply(self, status: HTTPStatus, body: Mapping[str, Any]) -> None:
            self._send(status, "application/json", json.dumps(body).encode())

        def _refuse(self, status: HTTPStatus, message: str) -> None:
            self._reply(status, messages.ErrorAnswer(message).to_json())

        def _guard(self) -> bool:
            self.signed = admitted(
                config, verifier, self.headers.get("Authorization"), self.command, self.path,
                audience_of(self.connection.getsockname()), str(self.client_address[0]))
            if self.signed is not None:
                return True
            log.warning("refused an unauthenticated %s %s", self.command, self.path)
            self._refuse(HTTPStatus.UNAUTHORIZED, auth.CALL_REFUSED)
            return False

        def do_GET(self) -> None:
            if self.path == paths.METRICS_PATH:  # open, like the sidecar's: no token
                data = launcher_metrics.render(supervisor.metrics)
                self._send(HTTPStatus.OK, "text/plain; version=0.0.4", data)
                return
            if self.path == paths.HEALTHZ_PATH:  # open: the API answers (for a probe)
                self._reply(HTTPStatus.OK, messages.Health("ok").to_json())
                return
            if not self._guard():
                return
            if self.path == paths.STATUS_PATH:
                self._reply(HTTPStatus.OK, supervisor.status_answer().to_json())
            else:
                self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint {self.path}")

        def do_POST(self) -> None:
            if not self._guard():
                return
            try:
                body = read_body(self.rfile, self.headers.get("Content-Length"), self.signed)
                if self.path == paths.RESTART_PATH:
                    answer = supervisor.restart(RestartRequest.parse(body))
                    self._reply(HTTPStatus.OK, answer.to_json())
                elif self.path == paths.STOP_PATH:
                    self._reply(HTTPStatus.OK, supervisor.stop().to_json())
                    supervisor.finish()
                else:
                    self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint {self.path}")
            except LauncherError as err:
                self._refuse(status_of(err), str(err))

    return Handler
