"""The one client of the control APIs (``ControlClient``): JSON over HTTP with a bearer
token, each call within one deadline, its answer bounded in size and read strictly, every
failure a ``ControlError``."""

from __future__ import annotations

import http.client
import io
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gemini.control.auth import Bearer, Credentials, signer_of
from gemini.control.inventory import InventoriesAnswer, InventoriesRequest, Inventory
from gemini.control.launcher import (
    FailureHint,
    HintAnswer,
    LauncherStatus,
    RestartAnswer,
    RestartRequest,
)
from gemini.control.messages import (
    ErrorAnswer,
    Health,
    NotifyAnswer,
    NotifyRequest,
    Peers,
    ProfileAnswer,
    ProfileRequest,
)
from gemini.control.paths import (
    COMMIT_PATH,
    COMMITTED_PATH,
    COMMITTED_STEPS_PATH,
    FAILURE_HINT_PATH,
    FETCH_PATH,
    FETCH_REPLICAS_PATH,
    HEALTHZ_PATH,
    INVENTORIES_PATH,
    INVENTORY_PATH,
    PEERS_PATH,
    PERSIST_PATH,
    PROFILE_PATH,
    RESTART_PATH,
    RESTORE_PATH,
    STATUS_PATH,
    STOP_PATH,
)
from gemini.control.signing import Signer, audience_of
from gemini.control.strict import parse_json, shown
from gemini.control.transfers import (
    CommitAnswer,
    CommitRequest,
    CommittedStepsAnswer,
    FetchAnswer,
    FetchReplicasAnswer,
    FetchReplicasRequest,
    FetchRequest,
    PersistAnswer,
    PersistRequest,
    RestoreAnswer,
    RestoreRequest,
    TransferRunning,
)

T = TypeVar("T")
DEFAULT_TIMEOUT_SECONDS = 5.0
# The peers a client calls (sidecars, launchers) run in images a job's author chooses, so an
# answer is taken only whole, in time, small and well formed; anything else is a ControlError.
DEFAULT_MAX_ANSWER_BYTES = 256 * 1024  # the largest real answer (an inventory) is a few KiB
MAX_ERROR_ANSWER_BYTES = 16 * 1024  # a refusal's {"error": ...} is a message, not data
REFUSAL_LOG_SECONDS = 60.0  # repeats of one kind of refusal from one address: DEBUG only
_READ_BYTES = 64 * 1024
_MIN_REDACTED_TOKEN = 8
# Parsing amplifies: 256 KiB of "[]," become ~5 MiB of Python objects. One parse at a time
# (each holds the GIL anyway) bounds that to one answer's worth per process, however many
# calls are in flight.
_PARSE_LOCK = threading.Lock()
# The name the module had before gemini.control became a package: logging set-ups name it.
log = logging.getLogger("gemini.control")


class ControlError(RuntimeError):
    """A call that did not get a valid answer: the address, the path and the reason (what
    the server answered, or why nothing came back)."""

    def __init__(self, address: str, path: str, reason: str, status: int | None = None,
                 detail: str | None = None) -> None:
        super().__init__(f"{address}{path} {reason}")
        self.address, self.path, self.reason = address, path, reason
        self.status = status  # the HTTP status of a refusal (None: no answer or a bad one)
        self.detail = detail  # the refusal's ErrorAnswer text, when it sent one


def _json_object(doc: object) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ValueError(f"the answer must be a JSON object, got {shown(doc)}")
    return doc


class _TooLarge(Exception):
    """An answer over the size a client takes."""


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


class DeadlineSocket:
    """A connected socket whose every send and receive ends by the call's deadline. A socket
    timeout alone bounds each read, and a peer sending a byte a second never trips it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def _arm(self) -> None:
        self._sock.settimeout(_left(self._deadline))

    def sendall(self, data: bytes) -> None:
        self._arm()
        self._sock.sendall(data)

    def recv_into(self, buffer: memoryview) -> int:
        self._arm()
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *_: object, **__: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        """Nothing: http.client closes its side before the body is read; the call closes the
        real socket once the answer is in."""


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: DeadlineSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)


def _read_capped(answer: http.client.HTTPResponse, limit: int) -> bytearray:
    """The answer's body, refused (_TooLarge) as soon as it is known to exceed `limit`: by its
    Content-Length before any of it is read, else once more than `limit` bytes came."""
    if answer.length is not None and answer.length > limit:
        raise _TooLarge(f"answered {answer.length} bytes, more than the {limit} it may")
    body = bytearray()
    while chunk := answer.read(min(_READ_BYTES, limit + 1 - len(body))):
        body += chunk
        if len(body) > limit:
            raise _TooLarge(f"answered more than the {limit} bytes it may")
    return body


class _RefusalLog:
    """Every answer a client refuses is logged once, with the peer's address and the reason:
    the first of its kind from an address in REFUSAL_LOG_SECONDS at WARNING, repeats at DEBUG
    (a hostile peer polled every 2 s must not flood the log)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}

    def note(self, address: str, path: str, kind: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            loud = now - self._last.get((address, kind), -math.inf) >= REFUSAL_LOG_SECONDS
            if loud:
                if len(self._last) > 4096:  # addresses come and go with pods
                    self._last = {k: t for k, t in self._last.items()
                                  if now - t < REFUSAL_LOG_SECONDS}
                self._last[(address, kind)] = now
        log.log(logging.WARNING if loud else logging.DEBUG,
                "refused the answer of %s%s (%s): %s", address, path, kind, reason)


_REFUSALS = _RefusalLog()


def signed_header(signer: Signer, method: str, target: str, audience: str,
                  body: bytes = b"") -> str:
    """The Authorization header for a request sent now (gemini.control.signing)."""
    return signer.header(method, target, audience, body, time.time())


class ControlClient:
    """One sidecar's or launcher's control API at ip:port (the caller picks the port). Every
    call returns the typed answer or raises ControlError within `timeout` seconds in all
    (connecting, sending and every byte of the answer), refusing an answer over
    `max_answer_bytes` before reading it all. Its errors never carry the token."""

    def __init__(self, ip: str, port: int, token: Bearer = "",
                 timeout: float = DEFAULT_TIMEOUT_SECONDS,
                 max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
                 audience: str | None = None) -> None:
        """`token`: Credentials sign as the operator, a job token as the job (auth.signer_of).
        `audience`: what the server checks the signature's address against; by default the
        address this client connects to."""
        self.address = f"{ip}:{port}"
        self._scheme, self._host, self._port, self._prefix = "http", ip, port, ""
        self.token = token.token if isinstance(token, Credentials) else token
        self._signer, self._audience = signer_of(token), audience
        self.timeout, self.max_answer_bytes = timeout, max_answer_bytes

    @classmethod
    def for_url(cls, url: str, token: str = "", timeout: float = DEFAULT_TIMEOUT_SECONDS,
                audience: str | None = None) -> ControlClient:
        """A client of the API at a base URL (the trainer is given its sidecar's URL)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the control API URL {url!r} is not http://host:port")
        default_port = 443 if parts.scheme == "https" else 80
        client = cls(parts.hostname, parts.port or default_port, token, timeout,
                     audience=audience)
        client._scheme, client._prefix = parts.scheme, parts.path.rstrip("/")
        client.address = url.rstrip("/")
        return client

    # -- the sidecar ---------------------------------------------------------------------
    def healthz(self) -> Health:
        return self._typed(HEALTHZ_PATH, None, Health.from_json)

    def inventory(self) -> Inventory:
        return self._typed(INVENTORY_PATH, None, Inventory.from_json)

    def inventories(self, request: InventoriesRequest) -> InventoriesAnswer:
        """Size this client's answer cap with `relayed_answer_bytes`."""
        return self._typed(INVENTORIES_PATH, request.to_json(), InventoriesAnswer.from_json)

    def notify(self, request: NotifyRequest) -> NotifyAnswer:
        return self._typed(COMMITTED_PATH, request.to_json(), NotifyAnswer.from_json)

    def peers(self, request: Peers) -> Peers:
        return self._typed(PEERS_PATH, request.to_json(),
                           lambda doc: Peers.from_json(doc, "/peers answer"))

    def profile(self, request: ProfileRequest) -> ProfileAnswer:
        return self._typed(PROFILE_PATH, request.to_json(), ProfileAnswer.from_json)

    # The transfers (rule 7 in gemini.control.paths): TransferRunning when the request's
    # wait_seconds passed first.
    def fetch(self, request: FetchRequest) -> FetchAnswer | TransferRunning:
        return self._transfer(FETCH_PATH, request.to_json(), FetchAnswer.from_json)

    def fetch_replicas(self, request: FetchReplicasRequest
                       ) -> FetchReplicasAnswer | TransferRunning:
        """Raises ControlError (status 502) when some held rank did not come."""
        return self._transfer(FETCH_REPLICAS_PATH, request.to_json(),
                              FetchReplicasAnswer.from_json)

    def persist(self, request: PersistRequest) -> PersistAnswer | TransferRunning:
        return self._transfer(PERSIST_PATH, request.to_json(), PersistAnswer.from_json)

    def commit(self, request: CommitRequest) -> CommitAnswer:
        return self._typed(COMMIT_PATH, request.to_json(), CommitAnswer.from_json)

    def restore(self, request: RestoreRequest) -> RestoreAnswer | TransferRunning:
        return self._transfer(RESTORE_PATH, request.to_json(), RestoreAnswer.from_json)

    def committed_steps(self) -> CommittedStepsAnswer:
        return self._typed(COMMITTED_STEPS_PATH, None, CommittedStepsAnswer.from_json)

    # -- the launcher --------------------------------------------------------------------
    def status(self) -> LauncherStatus:
        return self._typed(STATUS_PATH, None, LauncherStatus.from_json)

    def restart(self, request: RestartRequest) -> RestartAnswer:
        return self._typed(RESTART_PATH, request.to_json(), RestartAnswer.from_json)

    def stop(self) -> LauncherStatus:
        return self._typed(STOP_PATH, {},
                           lambda doc: LauncherStatus.from_json(doc, "/stop answer"))

    # -- the operator's hint server -----------------------------------------------------
    def failure_hint(self, hint: FailureHint) -> HintAnswer:
        # the job in the query too: the operator checks the token before reading the body
        query = urllib.parse.urlencode({"namespace": hint.namespace, "job": hint.job,
                                        "uid": hint.uid})
        return self._typed(f"{FAILURE_HINT_PATH}?{query}", hint.to_json(), HintAnswer.from_json)

    # -- any call ------------------------------------------------------------------------
    def call_json(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """GET `path` (no body) or POST the body; the answer's JSON object (any other JSON
        value is refused)."""
        return self._typed(path, body, _json_object)

    def _typed(self, path: str, body: Mapping[str, Any] | None,
               parse: Callable[[object], T]) -> T:
        status, raw = self._exchange(path, body)
        return self._parsed(path, status, raw, parse)

    def _transfer(self, path: str, body: Mapping[str, Any] | None,
                  parse: Callable[[object], T]) -> T | TransferRunning:
        status, raw = self._exchange(path, body)
        if status == 202:
            return self._parsed(path, status, raw, TransferRunning.from_json)
        return self._parsed(path, status, raw, parse)

    def _parsed(self, path: str, status: int, raw: bytearray,
                parse: Callable[[object], T]) -> T:
        if not 200 <= status < 300:
            raise self._refused(path, status, raw)
        with _PARSE_LOCK:
            try:
                doc = parse_json(raw or b"{}")
            except ValueError as err:
                raise self._refusal(path, "not JSON",
                                    f"answered a body that is not JSON ({err})") from err
            try:
                return parse(doc)
            # The readers raise ValueError; anything else an untrusted body provokes in one
            # is still that body's fault, and must reach the caller as a ControlError.
            except (ValueError, TypeError, LookupError) as err:
                raise self._refusal(path, "unexpected body",
                                    f"answered an unexpected body: {err}") from err

    def _exchange(self, path: str, body: Mapping[str, Any] | None) -> tuple[int, bytearray]:
        """Send the request and read the whole answer by the deadline: (status, body)."""
        return self._exchange_once(path, body)

    def _exchange_once(self, path: str, body: Mapping[str, Any] | None
                       ) -> tuple[int, bytearray]:
        deadline = time.monotonic() + self.timeout
        connection = http.client.HTTPSConnection if self._scheme == "https" else (
            http.client.HTTPConnection)
        conn = connection(self._host, self._port, timeout=self.timeout)
        connected: socket.socket | None = None
        try:
            conn.connect()
            connected = conn.sock
            conn.sock = DeadlineSocket(connected, deadline)  # type: ignore[assignment]
            self._send(conn, path, body, audience_of(connected.getpeername()))
            with conn.getresponse() as answer:
                ok = 200 <= answer.status < 300
                limit = self.max_answer_bytes if ok else MAX_ERROR_ANSWER_BYTES
                return answer.status, _read_capped(answer, limit)
        except _TooLarge as err:
            raise self._refusal(path, "too large", str(err)) from err
        except TimeoutError as err:
            if connected is None:  # no connection at all: a silent address, as before
                raise self._error(path, f"unreachable ({err})") from err
            raise self._refusal(path, "deadline", f"unreachable (no whole answer within "
                                                  f"{self.timeout:g} s)") from err
        except (OSError, http.client.HTTPException) as err:
            raise self._error(path, f"unreachable ({err})") from err
        finally:
            conn.close()
            if connected is not None:
                connected.close()

    def _send(self, conn: http.client.HTTPConnection, path: str,
              body: Mapping[str, Any] | None, dialed: str) -> None:
        headers = {"Content-Type": "application/json", "Connection": "close"}
        data = None if body is None else json.dumps(body).encode()
        method, target = "GET" if body is None else "POST", self._prefix + path
        if self._signer is not None:
            headers["Authorization"] = signed_header(
                self._signer, method, target, self._audience or dialed, data or b"")
        conn.request(method, target, data, headers)

    def _refused(self, path: str, status: int, raw: bytearray) -> ControlError:
        """The server's refusal (a status other than 2xx), with its ErrorAnswer when sent."""
        try:
            detail: str | None = ErrorAnswer.from_json(parse_json(raw)).error
        except ValueError:
            detail = None
        return self._error(path, f"answered {status} {bytes(raw[:300])!r}", status, detail)

    def _refusal(self, path: str, kind: str, reason: str) -> ControlError:
        """An answer this client does not take: logged once, and raised."""
        error = self._error(path, reason)
        _REFUSALS.note(self.address, path, kind, error.reason)
        return error

    def _error(self, path: str, reason: str, status: int | None = None,
               detail: str | None = None) -> ControlError:
        """A ControlError without the token in its text: a peer may echo it back."""
        return ControlError(self.address, path, self._redacted(reason), status,
                            None if detail is None else self._redacted(detail))

    def _redacted(self, text: str) -> str:
        # Job tokens are 43 random characters; a short test token would blank out words.
        secret = len(self.token) >= _MIN_REDACTED_TOKEN
        return text.replace(self.token, "<token>") if secret else text
