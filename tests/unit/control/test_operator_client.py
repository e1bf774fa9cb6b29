"""The operator's side of the contract (gemini_operator.calls.sidecars) against scripted servers on
loopback: typed calls to many ranks, silent ranks, persist before commit, placement delivery,
and the untyped calls kept for call sites not moved yet."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gemini.control.launcher import RestartAnswer, RestartRequest
from gemini.control.transfers import (
    CommitAnswer,
    FetchAnswer,
    FetchReplicasAnswer,
    FetchReplicasRequest,
    FetchRequest,
    PersistAnswer,
    ReplicaFetch,
    RestoreAnswer,
    RestoreRequest,
    TransferRunning,
)
from gemini.domain.placement import mixed_placement
from gemini_operator.calls import sidecars
from gemini_operator.calls.sidecars import DeliveryError, SidecarAddress, SidecarError
from tests.unit.control.server import Scripted, serve
from tests.unit.control.test_types import INVENTORY, STATUS

TOKEN = "job-secret"


@pytest.fixture
def two() -> Iterator[list[tuple[Scripted, int]]]:
    """Two scripted servers: ranks 0 and 1."""
    scripts = [Scripted(), Scripted()]
    servers = [serve(script) for script in scripts]
    try:
        yield [(script, port) for script, (_, port) in zip(scripts, servers, strict=True)]
    finally:
        for server, _ in servers:
            server.shutdown()
            server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _targets(two: list[tuple[Scripted, int]]) -> dict[int, tuple[str, int]]:
    return {r: ("127.0.0.1", port) for r, (_, port) in enumerate(two)}


def test_inventories_come_typed_and_a_silent_sidecar_is_named(
    two: list[tuple[Scripted, int]],
) -> None:
    for script, _ in two:
        script.answer("/inventory", INVENTORY.to_json())
    targets = _targets(two)
    assert sidecars.inventories(targets, TOKEN) == {0: INVENTORY, 1: INVENTORY}
    silent = _closed_port()
    got, errors = sidecars.inventories_each({**targets, 2: ("127.0.0.1", silent)}, TOKEN)
    assert got == {0: INVENTORY, 1: INVENTORY}
    assert len(errors) == 1
    assert errors[0].startswith(f"rank 2: 127.0.0.1:{silent}/inventory unreachable")
    with pytest.raises(SidecarError, match=f"rank 2: 127.0.0.1:{silent}/inventory"):
        sidecars.inventories({**targets, 2: ("127.0.0.1", silent)}, TOKEN)


def test_restart_sends_one_request_to_all_or_each_rank_its_own(
    two: list[tuple[Scripted, int]],
) -> None:
    for script, _ in two:
        script.answer("/restart", RestartAnswer("restarted", STATUS).to_json())
        script.answer("/status", STATUS.to_json())
    targets = _targets(two)
    same = RestartRequest(3, 7, "local", {"MASTER_ADDR": "127.0.0.1"})
    got = sidecars.restart(targets, TOKEN, same)
    assert got == {0: RestartAnswer("restarted", STATUS), 1: RestartAnswer("restarted", STATUS)}
    assert [s.bodies("/restart") for s, _ in two] == [[same.to_json()], [same.to_json()]]
    own = {0: RestartRequest(4), 1: RestartRequest(4, "latest")}
    sidecars.restart(targets, TOKEN, own)
    assert [s.bodies("/restart")[-1]["version"] for s, _ in two] == [None, "latest"]
    assert sidecars.launcher_statuses(targets, TOKEN) == {0: STATUS, 1: STATUS}


def test_fetch_restore_and_fetch_replicas(two: list[tuple[Scripted, int]]) -> None:
    (first, _), (second, _) = two
    first.answer("/fetch", FetchAnswer(0, 7, 10, 5, ("127.0.0.1:9",)).to_json())
    second.answer("/fetch-replicas", FetchReplicasAnswer(
        (ReplicaFetch(0, error="could not fetch rank 0"),)).to_json(), status=502)
    for script, _ in two:
        script.answer("/restore", RestoreAnswer(7, 10, 0.5).to_json())
    targets = _targets(two)
    got = sidecars.fetch({0: targets[0]}, TOKEN, {0: FetchRequest(0, 7, (1,), "shm")})
    assert got == {0: FetchAnswer(0, 7, 10, 5, ("127.0.0.1:9",))}
    assert first.bodies("/fetch") == [{"rank": 0, "version": 7, "holders": [1], "into": "shm",
                                       "wait_seconds": sidecars.TRANSFER_WAIT_SECONDS}]
    assert sidecars.restore(targets, TOKEN, RestoreRequest(7)) == {
        0: RestoreAnswer(7, 10, 0.5), 1: RestoreAnswer(7, 10, 0.5)}
    with pytest.raises(SidecarError, match=r"rank 1: .*/fetch-replicas answered 502"):
        sidecars.fetch_replicas({1: targets[1]}, TOKEN,
                                FetchReplicasRequest(version=7))


def test_a_transfer_still_running_is_reported_with_every_ranks_progress(
    two: list[tuple[Scripted, int]],
) -> None:
    (first, _), (second, _) = two
    first.answer("/restore", RestoreAnswer(7, 10, 0.5).to_json())
    second.answer("/restore", TransferRunning("restore", 1, 7, 3 << 30, 4 << 30, 2.5).to_json(),
                  status=202)
    with pytest.raises(sidecars.TransfersRunning,
                       match=r"rank 1: restore 3.00 of 4.00 GiB") as info:
        sidecars.restore(_targets(two), TOKEN, RestoreRequest(7))
    assert info.value.bytes_done() == ((3 << 30) + 10, (4 << 30) + 10)  # rank 0's 10 done
    assert second.bodies("/restore") == [{"version": 7,
                                          "wait_seconds": sidecars.TRANSFER_WAIT_SECONDS}]
    # a persist with a wait: the uploads under way are reported, nothing is committed
    for script, _ in two:
        script.answer("/persist", TransferRunning("persist", 0, 8, 1, None, 0.1).to_json(),
                      status=202)
        script.answer("/commit", CommitAnswer("marker", 8, ()).to_json())
    with pytest.raises(sidecars.TransfersRunning) as running:
        sidecars.persist_and_commit(_targets(two), TOKEN, 8, 5.0, wait=0.5)
    assert running.value.bytes_done() == (2, None)
    assert [s.bodies("/commit") for s, _ in two] == [[], []]


def test_a_transfer_answer_that_is_not_progress_is_refused(
    two: list[tuple[Scripted, int]],
) -> None:
    (first, _), _ = two
    first.answer("/fetch", {"state": "running", "kind": "upload", "done_bytes": 1,
                            "seconds": 1.0}, status=202)
    with pytest.raises(SidecarError, match="kind"):
        sidecars.fetch({0: _targets(two)[0]}, TOKEN, {0: FetchRequest(0, 7, (1,), "shm")})


def test_persist_goes_to_every_rank_before_the_lowest_commits(
    two: list[tuple[Scripted, int]],
) -> None:
    for script, _ in two:
        script.answer("/persist", PersistAnswer("k", 7, 10, 0.5, 5).to_json())
        script.answer("/commit", CommitAnswer("marker", 7, (2,)).to_json())
    targets = _targets(two)
    assert sidecars.persist_and_commit(targets, TOKEN, 7, 5.0) == CommitAnswer("marker", 7, (2,))
    assert [s.bodies("/persist") for s, _ in two] == [[{"version": 7}], [{"version": 7}]]
    assert [s.bodies("/commit") for s, _ in two] == [[{"version": 7}], []]

    two[1][0].answer("/persist", {"error": "S3: unreachable"}, status=502)
    with pytest.raises(SidecarError, match=r"rank 1: .*/persist answered 502"):
        sidecars.persist_and_commit(targets, TOKEN, 8, 5.0)
    assert [s.bodies("/commit") for s, _ in two] == [[{"version": 7}], []], "no commit"


def test_the_placement_is_delivered_as_typed_bodies_and_refusals_are_counted(
    two: list[tuple[Scripted, int]],
) -> None:
    placement = mixed_placement(2, 2)
    addresses = {r: SidecarAddress(r, "127.0.0.1", port, 7000 + r)
                 for r, (_, port) in enumerate(two)}
    bodies = sidecars.peers_bodies(placement, addresses)
    assert bodies[0].to_json() == {"peers": {"1": "127.0.0.1:7001"}, "hold_ranks": [1],
                                   "send_to": [1]}
    for rank, (script, _) in enumerate(two):
        script.answer("/peers", bodies[rank].to_json())
    sidecars.deliver_placement(placement, addresses, TOKEN)
    assert [s.bodies("/peers") for s, _ in two] == [[bodies[0].to_json()],
                                                    [bodies[1].to_json()]]

    two[1][0].answer("/peers", {"error": "peers [5] outside the world"}, status=400)
    assert sidecars.deliver_peers(addresses, {0: bodies[0]}, TOKEN) == []
    with pytest.raises(DeliveryError) as err:
        sidecars.deliver_placement(placement, addresses, TOKEN)
    assert (err.value.failed, err.value.total) == (1, 2)
    assert str(err.value).startswith("rank 1: /peers answered 400")
