"""The operator's hint server: a launcher whose training failed says so at once, so the
operator polls that job now instead of at its next round (up to POLL_SECONDS later).

``POST /v1/hints/failure?namespace=..&job=..&uid=..`` (gemini.control.launcher.FailureHint)
signed with the job's own token, which every pod of the job holds (gemini.control.signing; the
token itself never crosses the network). The job is named in the query, so the signature is
checked before any body byte is read; the body (the same hint, the one signed) must then come
within READ_TIMEOUT_SECONDS and name the same job. Any pod of the cluster can reach this port:
connections are gated (gemini.serving: per address and in total), a connection must send its
request header within HEADER_TIMEOUT_SECONDS, and refusals are logged folded and counted.

A hint is only "poll this job now": what failed, and whether anything did, still comes from
the operator's own poll of the job's launchers and sidecars, so a forged or repeated hint
costs a poll of the sender's own job, at most one per `min_interval_s`.
Answers: 202 HintAnswer; 400 a malformed query or body; 401 not signed by that job's token (or
stale, or replayed); 404 no such job (or another job of that name: the uid differs); 503 this
replica is not the leader (the launcher tries again, and a Service in front of several replicas
may pick the leader).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from gemini.control.launcher import FailureHint, HintAnswer
from gemini.control.paths import FAILURE_HINT_PATH, MAX_HINT_BYTES
from gemini.control.signing import HINTS_AUDIENCE
from gemini.control.strict import parse_json
from gemini.control.verifier import NonceLog, RequestVerifier
from gemini.serving.fds import log_accept_errors_once
from gemini.serving.gate import UNCOUNTED, ConnectionGate, ConnectionLimits
from gemini.serving.http import GatedHttpListener
from gemini_operator.cluster.cache import JobKey
from gemini_operator.core.render import JobRef

log = logging.getLogger(__name__)
MIN_INTERVAL_SECONDS = 0.25
HEADER_TIMEOUT_SECONDS = 5.0  # a connection must send its request by then (aiohttp keep-alive)
READ_TIMEOUT_SECONDS = 5.0  # the body (a few hundred bytes) after the token was checked

# Launchers send one hint at a time, from their pod's address (every pod of a host-network
# node shares one): 64 per address, 1024 in total.
HINT_LIMITS = ConnectionLimits(1024, 64)
TOKEN_LOOKUPS = 2  # at once: random tokens are read from the job's Secret


class HintGate:
    """At most one early poll per job every `min_interval_s`."""

    def __init__(self, min_interval_s: float = MIN_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s, self._clock = min_interval_s, clock
        self._last: dict[JobKey, float] = {}

    def admit(self, key: JobKey) -> bool:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.min_interval_s:
            return False
        self._last[key] = now
        if len(self._last) > 4096:  # forget jobs not hinted lately
            self._last = {k: t for k, t in self._last.items()
                          if now - t < self.min_interval_s}
        return True


class HintServer:
    """Serves the hint path on the operator's event loop. `job_uid(key)`: the uid of the job
    the cache holds (None: none); `job_token(ref)`: its job token (blocking: it may read a
    Secret); `poll_now(key)`: start a poll of the job (on the event loop)."""

    def __init__(self, job_uid: Callable[[JobKey], str | None],
                 job_token: Callable[[JobRef], str | None],
                 poll_now: Callable[[JobKey], None], leading: Callable[[], bool],
                 gate: HintGate | None = None,
                 observe: Callable[[str], None] = lambda result: None,
                 refused: Any = None, limits: ConnectionLimits = HINT_LIMITS) -> None:
        self._job_uid, self._job_token = job_uid, job_token
        self._poll_now, self._leading = poll_now, leading
        self._gate = gate or HintGate()
        self._observe = observe  # counts each hint by result (metrics)
        self._lookups = asyncio.Semaphore(TOKEN_LOOKUPS)
        self._refused = refused or UNCOUNTED  # connections refused (a Counter)
        self._limits = limits
        self._nonces = NonceLog()  # one for every job's hints: a recorded hint is not replayed
        self._runner: web.AppRunner | None = None
        self.listener: GatedHttpListener | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_HINT_BYTES)
        app.router.add_post(FAILURE_HINT_PATH, self._failure)
        return app

    async def start(self, host: str, port: int) -> int:
        # lingering_time 0: a refused request's unread body is never read (aiohttp would read
        # it for 10 s after the answer to keep the connection)
        self._runner = web.AppRunner(self.app(), access_log=None,
                                     keepalive_timeout=HEADER_TIMEOUT_SECONDS, lingering_time=0)
        await self._runner.setup()
        self.listener = GatedHttpListener(
            self._runner, ConnectionGate(self._limits),
            "hint server", self._refused)
        log_accept_errors_once(asyncio.get_running_loop(), "hint server")
        self.port = await self.listener.start(host, port)
        log.info("hint server on %s:%d%s", host, self.port, FAILURE_HINT_PATH)
        return self.port

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _failure(self, request: web.Request) -> web.Response:
        try:
            named = _named_job(request.query)
        except ValueError as err:
            return self._answer("malformed", 400, {"error": str(err)[:500]})
        key = (named.namespace, named.name)
        uid = self._job_uid(key)
        if uid is None or uid != named.uid:
            return self._answer("unknown", 404, {
                "error": f"no GeminiJob {named.namespace}/{named.name} with uid {named.uid}"})
        async with self._lookups:
            token = await asyncio.to_thread(self._job_token, named)
        sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        signed = None if not token else RequestVerifier(token.encode(), None, self._nonces).check(
            sent, request.method, request.raw_path, HINTS_AUDIENCE)
        if signed is None:
            return self._answer("unauthorized", 401, {
                "error": "not signed by this job's token (or stale, or replayed)"})
        try:
            async with asyncio.timeout(READ_TIMEOUT_SECONDS):
                body = await request.read()
            if not signed.body_matches(body):
                raise ValueError("the body is not the one signed")
            hint = FailureHint.from_json(parse_json(body))
        except (ValueError, web.HTTPRequestEntityTooLarge, TimeoutError) as err:
            return self._answer("malformed", 400, {"error": str(err)[:500] or "no body in time"})
        if (hint.namespace, hint.job, hint.uid) != (named.namespace, named.name, named.uid):
            return self._answer("malformed", 400, {"error": "the body names another job"})
        if not self._leading():
            return self._answer("not-leader", 503, {"error": "not the leader; try again"})
        polling = self._gate.admit(key)
        if polling:
            log.info("failure hint from rank %d of %s/%s (epoch %d): polling it now",
                     hint.rank, hint.namespace, hint.job, hint.epoch)
            self._poll_now(key)
        return self._answer("polled" if polling else "throttled", 202,
                            HintAnswer(polling).to_json())

    def _answer(self, result: str, status: int, body: Mapping[str, Any]) -> web.Response:
        self._observe(result)
        return web.json_response(dict(body), status=status)


def _named_job(query: Mapping[str, str]) -> JobRef:
    """The job a hint's query names (namespace, job, uid); ValueError naming what is missing."""
    missing = [k for k in ("namespace", "job", "uid") if not query.get(k)]
    if missing:
        raise ValueError(f"the query must name the job ({', '.join(missing)} missing): "
                         "a launcher older than this operator sends none; its failures are "
                         "still found by the next poll")
    return JobRef(query["job"], query["namespace"], query["uid"])
