"""The operator's hint server: a launcher whose training failed says so at once, so the
operator polls that job now instead of at its next round (up to POLL_SECONDS later).

``POST /v1/hints/failure`` (gemini.control.launcher.FailureHint) with the job's own token,
which every pod of the job holds. A hint is only "poll this job now": what failed, and
whether anything did, still comes from the operator's own poll of the job's launchers and
sidecars, so a forged or repeated hint costs a poll of the sender's own job, at most one per
`min_interval_s`.
Answers: 202 HintAnswer; 400 a malformed body; 401 not that job's token; 404 no such job
(or another job of that name: the uid differs); 503 this replica is not the leader (the
launcher tries again, and a Service in front of several replicas may pick the leader).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from gemini.control.auth import may_call
from gemini.control.launcher import FailureHint, HintAnswer
from gemini.control.paths import FAILURE_HINT_PATH, MAX_HINT_BYTES
from gemini.control.strict import parse_json
from gemini_operator.cluster.cache import JobKey
from gemini_operator.core.render import JobRef

log = logging.getLogger(__name__)
MIN_INTERVAL_SECONDS = 0.25
HEADER_TIMEOUT_SECONDS = 5.0  # a connection must send its request by then (aiohttp keep-alive)
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
                 observe: Callable[[str], None] = lambda result: None) -> None:
        self._job_uid, self._job_token = job_uid, job_token
        self._poll_now, self._leading = poll_now, leading
        self._gate = gate or HintGate()
        self._observe = observe  # counts each hint by result (metrics)
        self._lookups = asyncio.Semaphore(TOKEN_LOOKUPS)
        self._runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_HINT_BYTES)
        app.router.add_post(FAILURE_HINT_PATH, self._failure)
        return app

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None,
                                     keepalive_timeout=HEADER_TIMEOUT_SECONDS)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        addresses = self._runner.addresses  # the bound port, when 0 asked for any
        self.port = int(addresses[0][1]) if addresses else port
        log.info("hint server on %s:%d%s", host, self.port, FAILURE_HINT_PATH)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _failure(self, request: web.Request) -> web.Response:
        try:
            hint = FailureHint.from_json(parse_json(await request.read()))
        except (ValueError, web.HTTPRequestEntityTooLarge) as err:
            return self._answer("malformed", 400, {"error": str(err)[:500]})
        key = (hint.namespace, hint.job)
        uid = self._job_uid(key)
        if uid is None or uid != hint.uid:
            return self._answer("unknown", 404, {
                "error": f"no GeminiJob {hint.namespace}/{hint.job} with uid {hint.uid}"})
        async with self._lookups:
            token = await asyncio.to_thread(self._job_token,
                                            JobRef(hint.job, hint.namespace, hint.uid))
        sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        # no control digest: the job token is the credential here, as in the pods' own APIs
        if not token or not may_call(sent, token.encode(), "", job_token_allowed=True):
            return self._answer("unauthorized", 401, {"error": "not this job's token"})
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
