"""ControlClient against a real HTTP server on loopback: each call's method, path and body,
its typed answer, and one error type for refusals, silence and answers of the wrong shape."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from gemini.control import auth, launcher
from gemini.control import paths as control_paths
from gemini.control.client import ControlClient, ControlError
from gemini.control.inventory import InventoriesAnswer, InventoriesRequest
from gemini.control.launcher import RestartAnswer, RestartRequest
from gemini.control.messages import (
    Health,
    NotifyAnswer,
    NotifyRequest,
    ProfileAnswer,
    ProfileIteration,
    ProfileRequest,
)
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
    ReplicaFetch,
    RestoreAnswer,
    RestoreRequest,
)
from gemini.control.verifier import RequestVerifier
from tests.unit.control.server import Scripted
from tests.unit.control.test_types import INVENTORY, PEERS, STATUS

TOKEN = "job-secret"

# (client method, its argument or None, path, HTTP method, the server's answer)
CALLS: list[tuple[str, Any, str, str, Any]] = [
    ("healthz", None, "/healthz", "GET", Health()),
    ("inventory", None, "/inventory", "GET", INVENTORY),
    ("inventories", InventoriesRequest({1: "10.0.0.1:7080"}), "/inventories", "POST",
     InventoriesAnswer({0: INVENTORY}, {1: "no answer within the deadline"})),
    ("notify", NotifyRequest(7, 0.5), "/v1/local/committed", "POST", NotifyAnswer(7)),
    ("peers", PEERS, "/peers", "POST", PEERS),
    ("profile", ProfileRequest((ProfileIteration(1.0, ((0.0, 0.5),)),)), "/profile", "POST",
     ProfileAnswer(1)),
    ("fetch", FetchRequest(0, 7, (1,), "shm"), "/fetch", "POST",
     FetchAnswer(0, 7, 10, 5, ("127.0.0.1:1",))),
    ("fetch_replicas", FetchReplicasRequest(version=7), "/fetch-replicas", "POST",
     FetchReplicasAnswer((ReplicaFetch(1, 7, 10, ("127.0.0.1:1",)),))),
    ("persist", PersistRequest(7), "/persist", "POST", PersistAnswer("k", 7, 10, 0.5, 5)),
    ("commit", CommitRequest(7), "/commit", "POST", CommitAnswer("m", 7, ())),
    ("restore", RestoreRequest(), "/restore", "POST", RestoreAnswer(7, 10, 0.5)),
    ("committed_steps", None, "/committed-steps", "GET", CommittedStepsAnswer((5, 7))),
    ("status", None, "/status", "GET", STATUS),
    ("restart", RestartRequest(3, 7, "peer", {"MASTER_PORT": "1"}), "/restart", "POST",
     RestartAnswer("restarted", STATUS)),
    ("stop", None, "/stop", "POST", STATUS),
    ("failure_hint", launcher.FailureHint("team", "llm", "uid-1", 3, 2), "/v1/hints/failure",
     "POST", launcher.HintAnswer(True)),
]


@pytest.mark.parametrize(("name", "request_", "path", "method", "answer"), CALLS,
                         ids=[c[0] for c in CALLS])
def test_each_call_sends_its_body_to_its_path_and_returns_the_typed_answer(
    scripted: tuple[Scripted, int], name: str, request_: Any, path: str, method: str,
    answer: Any,
) -> None:
    script, port = scripted
    script.answer(path, answer.to_json())
    client = ControlClient("127.0.0.1", port, TOKEN, timeout=5)
    call = getattr(client, name)
    got = call() if request_ is None else call(request_)
    assert got == answer
    seen = script.seen[-1]
    assert (seen.method, seen.path) == (method, path)
    # signed for this address, with this body: the token itself is not sent
    verifier = RequestVerifier(TOKEN.encode(), None)
    target = path + (f"?{seen.query}" if seen.query else "")
    signed = verifier.check(seen.headers["Authorization"].encode(), method, target,
                            f"127.0.0.1:{port}")
    assert signed is not None and signed.body_matches(seen.body)
    assert TOKEN not in str(seen.headers)
    assert seen.headers["Content-Type"] == "application/json"
    if request_ is not None:
        assert script.bodies(path)[-1] == request_.to_json()
    # the hint names its job in the query too: the operator checks the token before the body
    assert seen.query == ("namespace=team&job=llm&uid=uid-1" if name == "failure_hint" else "")


def test_every_path_of_both_apis_has_a_client_call() -> None:
    covered = {c[2] for c in CALLS} | {control_paths.NOTIFY_PATH, control_paths.METRICS_PATH}
    paths = {v for k, v in vars(control_paths).items() if k.endswith("_PATH")}
    assert paths == covered


def test_a_refusal_names_address_path_status_and_the_servers_reason(
    scripted: tuple[Scripted, int],
) -> None:
    script, port = scripted
    script.answer("/restart", {"error": "restart epoch 1 is not newer than 2"}, status=409)
    with pytest.raises(ControlError) as err:
        ControlClient("127.0.0.1", port, TOKEN).restart(RestartRequest(1))
    assert (err.value.address, err.value.path, err.value.status) == (
        f"127.0.0.1:{port}", "/restart", 409)
    assert err.value.detail == "restart epoch 1 is not newer than 2"
    assert str(err.value).startswith(f"127.0.0.1:{port}/restart answered 409 b'")
    assert "not newer" in str(err.value)


def test_a_silent_address_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ControlError) as err:
        ControlClient("127.0.0.1", port, TOKEN, timeout=2).inventory()
    assert err.value.status is None
    assert str(err.value).startswith(f"127.0.0.1:{port}/inventory unreachable (")


def test_a_server_that_never_answers_times_out() -> None:
    with socket.socket() as listener:  # accepts connections (backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ControlError, match="unreachable"):
            ControlClient("127.0.0.1", port, TOKEN, timeout=0.3).status()
        assert time.monotonic() - started < 5


def test_an_answer_of_the_wrong_shape_is_an_error_naming_the_field(
    scripted: tuple[Scripted, int],
) -> None:
    script, port = scripted
    doc = INVENTORY.to_json()
    del doc["job"]
    script.answer("/inventory", doc)
    script.answer_raw("/status", b"<html>proxy error</html>")
    client = ControlClient("127.0.0.1", port, TOKEN)
    with pytest.raises(ControlError, match="/inventory answered an unexpected body: "
                                           "/inventory answer: 'job' is required"):
        client.inventory()
    with pytest.raises(ControlError, match="/status answered a body that is not JSON"):
        client.status()


def test_a_client_for_a_url_posts_the_trainers_notice_without_a_token_when_none_is_set(
    scripted: tuple[Scripted, int],
) -> None:
    script, port = scripted
    script.answer("/v1/local/committed", {"accepted": 4}, status=202)
    client = ControlClient.for_url(f"http://127.0.0.1:{port}/", "")
    assert client.notify(NotifyRequest(4)) == NotifyAnswer(4)
    assert "Authorization" not in script.seen[-1].headers
    with pytest.raises(ValueError, match="not http://host:port"):
        ControlClient.for_url("127.0.0.1:7001")


def test_call_json_gets_or_posts_any_path_and_refuses_a_non_object(
    scripted: tuple[Scripted, int],
) -> None:
    script, port = scripted
    script.answer("/anything", {"b": 2})
    client = ControlClient("127.0.0.1", port, TOKEN)
    assert client.call_json("/anything") == {"b": 2}
    assert client.call_json("/anything", {"a": 1}) == {"b": 2}
    assert [s.method for s in script.seen] == ["GET", "POST"]
    assert script.bodies("/anything") == [None, {"a": 1}]
    script.answer("/anything", [1, 2])
    with pytest.raises(ControlError, match="must be a JSON object"):
        client.call_json("/anything")


def test_an_ipv6_address_is_bracketed_in_the_url() -> None:
    client = ControlClient("::1", 1, TOKEN, timeout=1)
    with pytest.raises(ControlError) as err:
        client.healthz()
    assert err.value.address == "::1:1" and "unreachable" in str(err.value)


def test_a_refused_operator_signature_is_not_followed_by_another_credential(
    scripted: tuple[Scripted, int],
) -> None:
    """Issue 45, item 3: a pod answering 401 to the operator's signature (an impostor, say) is
    not sent the job token to try, nor anything signed with it; no token crosses the wire."""
    script, port = scripted
    script.answer("/restart", {"error": "unauthorized"}, status=401)
    with pytest.raises(ControlError) as err:
        ControlClient("127.0.0.1", port, auth.Credentials("control-token")).restart(
            RestartRequest(1))
    assert err.value.status == 401
    [header] = [s.headers["Authorization"] for s in script.seen]
    assert header.startswith("Gemini-Operator ") and "control-token" not in header
