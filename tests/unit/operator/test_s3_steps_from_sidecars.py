"""The operator holds no S3 credentials: it asks one of the job's own sidecars for the steps
committed to S3, and never reads the job's credentials Secret (issue 14, item 6)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from gemini.control import paths
from gemini.control.signing import (
    CONTROL_PUBLIC_KEY_ENV,
    Caller,
    control_public_key,
    public_key_setting,
)
from gemini.control.verifier import RequestVerifier
from gemini_operator.calls.tokens import JobTokens
from gemini_operator.calls.worker_calls import WorkerCalls
from gemini_operator.core import naming
from gemini_operator.core.outcome import S3Unreadable
from gemini_operator.core.render import RenderConfig
from gemini_operator.core.spec import Persistence
from gemini_operator.core.types import JobView
from tests.unit.operator.fake_kube import FakeKube

TOKEN = "peer-token-0123456789abcdef"
CONTROL = "control-token-0123456789abcdef"
JOB = JobView("train", "team-a", "uid-1", 1, {})
PERSISTENCE = Persistence(bucket="ckpt", prefix="gemini", endpoint="http://s3.example:80",
                          credentials_secret="s3-credentials")


class FakeSidecar(BaseHTTPRequestHandler):
    """GET /committed-steps as the sidecar answers it (`answer`: status and body)."""

    answer: ClassVar[tuple[int, dict[str, Any]]] = (200, {"steps": [4, 2]})
    seen: ClassVar[list[tuple[str, str]]] = []

    def do_GET(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization", "")))
        status, body = type(self).answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sidecar() -> Iterator[int]:
    FakeSidecar.answer, FakeSidecar.seen = (200, {"steps": [4, 2]}), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSidecar)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _kube(pods: list[dict[str, Any]]) -> FakeKube:
    """The job's pods and Secrets: its token, the operator's control token, S3 credentials."""
    return FakeKube(pods=pods, secrets={
        (JOB.namespace, naming.secret_name(JOB.name)): {"token": TOKEN},
        (JOB.namespace, naming.control_secret_name(JOB.name)): {"token": CONTROL},
        (JOB.namespace, PERSISTENCE.credentials_secret): {"accessKey": "a-credential"},
    })


def _pod(rank: int, phase: str = "Running", owner: str = JOB.uid) -> dict[str, Any]:
    return {
        "metadata": {"name": f"train-worker-{rank}", "namespace": JOB.namespace,
                     "uid": f"pod-{rank}",
                     "labels": {naming.LABEL_JOB: JOB.name, naming.LABEL_RANK: str(rank),
                                naming.LABEL_RESTART_ATTEMPT: "0"},
                     "ownerReferences": [{"uid": owner, "controller": True}]},
        "status": {"phase": phase, "podIP": "127.0.0.1"},
    }


def _calls(kube: FakeKube, port: int) -> WorkerCalls:
    tokens = JobTokens(kube, None)  # type: ignore[arg-type]
    return WorkerCalls(kube, RenderConfig(sidecar_port=port - 1), tokens)  # type: ignore[arg-type]


def test_the_steps_come_from_the_jobs_own_sidecar_and_no_credentials_are_read(sidecar):
    kube = _kube([_pod(0), _pod(1, owner="another-job")])
    assert _calls(kube, sidecar).committed_steps(JOB, PERSISTENCE) == [2, 4]
    [(path, header)] = FakeSidecar.seen
    # signed as the operator with this job's control token, which itself is not sent
    key = public_key_setting({CONTROL_PUBLIC_KEY_ENV: control_public_key(CONTROL)})
    signed = RequestVerifier(TOKEN.encode(), key).check(
        header.encode(), "GET", path, f"127.0.0.1:{sidecar}")
    assert path == paths.COMMITTED_STEPS_PATH and signed is not None
    assert signed.caller is Caller.OPERATOR and CONTROL not in header
    assert kube.secret_reads == [("team-a", naming.secret_name("train"), "token"),
                                 ("team-a", naming.control_secret_name("train"), "token")]


def test_a_sidecar_that_s3_refuses_makes_the_steps_unreadable(sidecar):
    FakeSidecar.answer = (502, {"error": "S3 request failed: AccessDenied"})
    with pytest.raises(S3Unreadable, match="AccessDenied"):
        _calls(_kube([_pod(0)]), sidecar).committed_steps(JOB, PERSISTENCE)


def test_without_a_sidecar_to_ask_the_step_the_status_records_is_used(sidecar):
    kube = _kube([_pod(0, phase="Failed")])
    recorded = JobView("train", "team-a", "uid-1", 1, {},
                       {"checkpoint": {"persistedStep": 7}})
    assert _calls(kube, sidecar).committed_steps(recorded, PERSISTENCE) == [7]
    with pytest.raises(S3Unreadable, match="no sidecar of the job answers"):
        _calls(kube, sidecar).committed_steps(JOB, PERSISTENCE)
    assert FakeSidecar.seen == [] and kube.secret_reads == []


def test_no_persistence_lists_nothing(sidecar):
    kube = _kube([_pod(0)])
    assert _calls(kube, sidecar).committed_steps(JOB, None) == []
    assert FakeSidecar.seen == [] and kube.secret_reads == []


def test_a_sidecar_older_than_the_call_falls_back_to_the_recorded_step(sidecar):
    FakeSidecar.answer = (404, {"error": "not found"})
    recorded = JobView("train", "team-a", "uid-1", 1, {},
                       {"checkpoint": {"persistedStep": 9}})
    assert _calls(_kube([_pod(0)]), sidecar).committed_steps(recorded, PERSISTENCE) == [9]
