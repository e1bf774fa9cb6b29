"""Tells the operator at once that this rank's training failed (gemini_operator.calls.hints), so it
polls the job now instead of at its next round. Best effort, off the launcher's own path: the
operator's poll finds the failure anyway, a poll interval later."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gemini.control.client import ControlClient, ControlError
from gemini.control.launcher import FailureHint
from gemini.control.signing import HINTS_AUDIENCE

log = logging.getLogger(__name__)
URL_ENV = "GEMINI_OPERATOR_HINT_URL"
TRIES = 3  # a 503 (not the leader) or no answer: a Service may pick another replica
TIMEOUT_SECONDS = 1.0
RETRY_SECONDS = 0.2


@dataclass(frozen=True)
class FailureHints:
    url: str
    token: str = field(repr=False)
    namespace: str
    job: str
    uid: str
    rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FailureHints | None:
        """None unless the operator rendered its hint URL and the job's identity."""
        env = os.environ if env is None else env
        url, token = env.get(URL_ENV, ""), env.get("GEMINI_AUTH_TOKEN", "")
        namespace, job, uid = (env.get(k, "") for k in (
            "GEMINI_NAMESPACE", "GEMINI_JOB", "GEMINI_JOB_UID"))
        rank = env.get("GEMINI_RANK", "")
        if not (url and token and namespace and job and uid and rank.isdigit()):
            return None
        return cls(url, token, namespace, job, uid, int(rank))

    def send(self, epoch: int) -> threading.Thread:
        """Send the hint for `epoch` from a daemon thread (returned, for tests to join)."""
        thread = threading.Thread(target=self._send, args=(epoch,), daemon=True,
                                  name="failure-hint")
        thread.start()
        return thread

    def _send(self, epoch: int) -> None:
        hint = FailureHint(self.namespace, self.job, self.uid, self.rank, epoch)
        try:
            client = ControlClient.for_url(self.url, self.token, timeout=TIMEOUT_SECONDS,
                                           audience=HINTS_AUDIENCE)
        except ValueError as err:  # a URL that is not http(s)://host[:port]
            log.warning("no failure hints: %s", err)
            return
        for attempt in range(TRIES):
            try:
                answer = client.failure_hint(hint)
            except ControlError as err:
                if err.status in (None, 503) and attempt + 1 < TRIES:
                    time.sleep(RETRY_SECONDS)
                    continue
                log.warning("could not tell the operator of the failure: %s (it finds it at "
                            "its next poll)", err)
                return
            log.info("told the operator of the failure (epoch %d)%s", epoch,
                     "" if answer.polling else "; it polled the job moments ago")
            return
