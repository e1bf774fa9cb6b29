"""Every request and answer of the control contract: round trips through JSON text, the wire
format the servers and clients exchanged before the contract (field names and order), and
strict refusals that name the field."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from gemini.control import inventory, launcher, messages, transfers
from gemini.control.inventory import (
    InventoriesAnswer,
    InventoriesRequest,
    Inventory,
    LocalCopy,
    MemoryUse,
    PeerSending,
    ReplicaCopy,
    Sending,
)
from gemini.control.launcher import (
    FailureHint,
    HintAnswer,
    LauncherStatus,
    Parked,
    Progress,
    RestartAnswer,
    RestartRequest,
    RestoreOrder,
    StandbyState,
)
from gemini.control.messages import (
    ErrorAnswer,
    Health,
    NotifyAnswer,
    NotifyRequest,
    Peers,
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
    TransferRunning,
)

PEERS = Peers({1: "10.0.0.1:7070", 2: "10.0.0.2:7070"}, (2,), (1,))
INVENTORY = Inventory(
    job="train", rank=0, world_size=4,
    local=(LocalCopy(0, 7, True, 1024, 3735928559), LocalCopy(0, 8, False, 1024, 0)),
    replicas=(ReplicaCopy(2, 7, True, 2048, 2048, 12345),),
    sending=Sending("interleaved", 8, 1, True, None, "fits the idle spans",
                    {1: PeerSending(7, 8, "", 0.25)}),
    memory=MemoryUse(2048, 1 << 30), placement=PEERS,
)
STATUS = LauncherStatus(
    state="running", pid=4242, epoch=3, restarts=2, exit_code=None, exited_at=None,
    started_at=1764600000.5, warm=True, standby=StandbyState(4243, False),
    restore=RestoreOrder(7, "peer"), progress=Progress(9, 1764600010.25, 1.5), port=7071,
)
IDLE = LauncherStatus(
    state="exited", pid=None, epoch=0, restarts=0, exit_code=-15, exited_at=1764600020.0,
    started_at=None, warm=False, standby=None, restore=RestoreOrder("12", "local"),
    progress=None, port=7071,
)

EXAMPLES: list[Any] = [
    ErrorAnswer("send the job token"),
    Health(),
    NotifyRequest(7, 0.125, rank=0, seq=15, slot=1, bytes=1024, checksum=99, path="/dev/shm/x"),
    NotifyRequest(7),
    NotifyAnswer(7),
    FailureHint("team", "llm", "uid-1", 3, 2),
    HintAnswer(False),
    PEERS,
    Peers(),
    INVENTORY,
    dataclasses.replace(INVENTORY, heartbeat=True, progress=Progress(12, 1764600000.5, 0.25)),
    dataclasses.replace(INVENTORY, heartbeat=True),  # no step yet
    dataclasses.replace(INVENTORY, heartbeat=True, parked=Parked(3, "RuntimeError: gloo", 1.5)),
    ProfileRequest((ProfileIteration(0.5, ((0.0, 0.125), (0.25, 0.375))),
                    ProfileIteration(0.25, ()))),
    ProfileAnswer(2),
    FetchRequest(0, 7, (1, "10.0.0.9:7070"), "shm"),
    FetchRequest(3),
    FetchRequest(3, 9, (1,), "store", 0.5),
    TransferRunning("fetch", 3, 9, 1024, 4096, 1.5),
    TransferRunning("fetch-replicas", None, None, 0, None, 0.0),
    FetchAnswer(0, 7, 1024, 99, ("10.0.0.1:7070",)),
    FetchReplicasRequest({2: (3, "10.0.0.3:7070")}, 7),
    FetchReplicasRequest(),
    FetchReplicasAnswer((ReplicaFetch(2, 7, 2048, ("10.0.0.2:7070",)),
                         ReplicaFetch(3, error="could not fetch rank 3"))),
    PersistRequest(7),
    PersistRequest(),
    PersistRequest(7, 0.0),
    PersistAnswer("gemini/ns/train/uid-1/step-7/rank-0.bin", 7, 1024, 0.5, 99),
    CommitRequest(7),
    CommitAnswer("gemini/ns/train/uid-1/step-7/COMMITTED", 7, (3, 4)),
    RestoreRequest(7),
    RestoreRequest(),
    RestoreAnswer(7, 1024, 0.75),
    CommittedStepsAnswer((5, 7)),
    CommittedStepsAnswer(()),
    RestartRequest(2, 7, "peer", {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"}),
    RestartRequest(1, "latest"),
    RestartRequest(1),
    STATUS,
    IDLE,
    dataclasses.replace(STATUS, state="parked", in_process=2, error="RuntimeError: gloo"),
    RestartAnswer("restarted", STATUS),
    RestartAnswer("already", IDLE),
    InventoriesRequest({1: "10.0.0.1:7080", 2: "10.0.0.2:7080"}, 1.5),
    InventoriesRequest({}),
    InventoriesAnswer({0: INVENTORY}, {2: "10.0.0.2:7080/inventory: unreachable"}),
    InventoriesAnswer({}, {}),
]


@pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: type(v).__name__)
def test_every_type_survives_a_round_trip_through_json_text(value: Any) -> None:
    text = json.dumps(value.to_json())
    assert type(value).from_json(json.loads(text)) == value


def test_every_request_and_answer_type_has_an_example() -> None:
    wire = {name for module in (messages, inventory, transfers, launcher)
            for name, obj in vars(module).items()
            if isinstance(obj, type) and hasattr(obj, "from_json")}
    assert wire <= {type(v).__name__ for v in EXAMPLES}


# -- the wire format is the one the hand-built dicts had ---------------------------------------

def test_operator_bodies_are_written_as_before() -> None:
    assert json.dumps(FetchRequest(1, 7, (2,), "shm").to_json()) == json.dumps(
        {"rank": 1, "version": 7, "holders": [2], "into": "shm"})
    assert FetchReplicasRequest(version=7).to_json() == {"holders": {}, "version": 7}
    env = {"MASTER_ADDR": "10.0.0.1"}
    assert json.dumps(RestartRequest(1, None, "local", env).to_json()) == json.dumps(
        {"epoch": 1, "version": None, "source": "local", "env": env})
    assert RestoreRequest(7).to_json() == PersistRequest(7).to_json() == {"version": 7}
    assert CommitRequest(7).to_json() == {"version": 7}
    assert json.dumps(PEERS.to_json()) == json.dumps(
        {"peers": {"1": "10.0.0.1:7070", "2": "10.0.0.2:7070"}, "hold_ranks": [2],
         "send_to": [1]})


def test_the_trainers_notice_is_written_as_before() -> None:
    notice = NotifyRequest(version=7, stall_seconds=0.5, rank=1, seq=3, slot=0, bytes=10,
                           checksum=5, path="/dev/shm/p")
    assert json.dumps(notice.to_json()) == json.dumps(
        {"rank": 1, "version": 7, "seq": 3, "slot": 0, "bytes": 10, "checksum": 5,
         "path": "/dev/shm/p", "stall_seconds": 0.5})


def test_answers_keep_their_field_order() -> None:
    assert list(INVENTORY.to_json()) == ["job", "rank", "world_size", "local", "replicas",
                                         "sending", "memory", "placement"]
    assert list(STATUS.to_json()) == ["state", "pid", "epoch", "restarts", "exit_code",
                                      "exited_at", "started_at", "warm", "standby", "restore",
                                      "progress", "port", "in_process", "error"]
    assert list(RestartAnswer("already", STATUS).to_json())[:2] == ["result", "state"]
    assert ReplicaFetch(3, error="gone").to_json() == {"rank": 3, "error": "gone"}


# -- what senders may leave out, as the servers always allowed ---------------------------------

def test_optional_keys_take_the_servers_defaults() -> None:
    assert Peers.from_json({"send_to": [5]}) == Peers({}, (), (5,))
    assert FetchRequest.from_json({"rank": 0, "version": 1, "holders": [1]}) == FetchRequest(
        0, 1, (1,), None)
    assert FetchReplicasRequest.from_json({}) == FetchReplicasRequest()
    assert FetchReplicasRequest.from_json({"holders": None, "version": 3}).version == 3
    assert RestoreRequest.from_json({}) == RestoreRequest(None)
    assert RestartRequest.from_json({"epoch": 9}) == RestartRequest(9, None, "local", None)
    assert NotifyRequest.from_json({"rank": 0, "version": 1, "checksum": 5}) == NotifyRequest(
        1, None, rank=0, checksum=5)


def test_unknown_keys_are_ignored_so_newer_senders_can_add_fields() -> None:
    assert CommitRequest.from_json({"version": 3, "reason": "suspend"}) == CommitRequest(3)


def test_the_environment_form_of_a_peer_map_is_taken() -> None:
    got = Peers.from_json({"peers": "1=10.0.0.1:7070, 2=[::1]:7070", "hold_ranks": [1]})
    assert got == Peers({1: "10.0.0.1:7070", 2: "[::1]:7070"}, (1,), ())
    assert Peers.from_json({"peers": '{"3": "h:1"}'}).peers == {3: "h:1"}


# -- strict refusals ---------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "doc", "message"), [
    pytest.param(FetchRequest, {}, "/fetch body: 'rank' is required", id="missing"),
    pytest.param(FetchRequest, {"rank": "0"}, "'rank' must be an integer >= 0, got '0'",
                 id="string for an integer"),
    pytest.param(FetchRequest, {"rank": True}, "'rank' must be an integer >= 0, got True",
                 id="bool for an integer"),
    pytest.param(FetchRequest, {"rank": 0, "holders": [1, "nohost"]}, "'holders' must be",
                 id="holder without a port"),
    pytest.param(FetchRequest, {"rank": 0, "into": "disk"}, "'into' must be", id="into"),
    pytest.param(FetchRequest, {"rank": 0, "version": -1}, "'version' must be an integer >= 0",
                 id="negative version"),
    pytest.param(PersistRequest, {"version": 3, "wait_seconds": 61},
                 "'wait_seconds' must be a number of seconds from 0 to 60", id="long wait"),
    pytest.param(RestoreRequest, {"wait_seconds": -1}, "'wait_seconds' must be",
                 id="negative wait"),
    pytest.param(TransferRunning, {"kind": "copy", "done_bytes": 0, "seconds": 0},
                 "'kind' must be one of fetch, fetch-replicas, persist, restore",
                 id="transfer kind"),
    pytest.param(CommitRequest, {"version": None}, "/commit body: 'version' must be",
                 id="null for a required integer"),
    pytest.param(CommitRequest, [7], "/commit body: the body must be a JSON object",
                 id="not an object"),
    pytest.param(NotifyRequest, {"version": 3, "stall_seconds": "1"}, "'stall_seconds' must",
                 id="string for a number"),
    pytest.param(Peers, {"hold_ranks": [1, "2"]}, "'hold_ranks' must be a list of ranks",
                 id="rank as a string"),
    pytest.param(Peers, {"peers": {"one": "h:1"}}, "'peers' must be an object keyed by rank",
                 id="peer key"),
    pytest.param(Peers, {"peers": {"1": "h"}}, "'peers.1' must be \"host:port\"",
                 id="peer address"),
    pytest.param(Peers, {"peers": "1:h:1"}, "'peers' must be entries", id="peer text"),
    pytest.param(Peers, {"peers": None}, "'peers' must be an object", id="null peers"),
    pytest.param(FetchReplicasRequest, {"holders": {"2": "h:1"}}, "'holders.2' must be a list",
                 id="holders of a rank"),
    pytest.param(ProfileRequest, {"iterations": []}, "'iterations' must not be empty",
                 id="empty profile"),
    pytest.param(ProfileRequest, {"iterations": [{"length": 1, "ops": [[0]]}]},
                 "'iterations[0].ops' must be a list of [start, end] pairs", id="profile op"),
    pytest.param(RestartRequest, {"epoch": -1}, "'epoch' must be an integer >= 0",
                 id="negative epoch"),
    pytest.param(RestartRequest, {"epoch": 2, "version": "x"},
                 "'version' must be a step number, \"latest\" or null", id="restart version"),
    pytest.param(RestartRequest, {"epoch": 2, "source": "tape"},
                 "'source' must be one of local, peer, s3", id="restart source"),
    pytest.param(RestartRequest, {"epoch": 1, "env": {"A=B": "x"}}, "'env' must be",
                 id="env name with ="),
    pytest.param(RestartRequest, {"epoch": 1, "env": {"A": 1}}, "'env' must be",
                 id="env value not a string"),
    pytest.param(RestartRequest, {"epoch": 1, "env": {f"V{i}": "" for i in range(65)}},
                 "'env' must be an object of at most 64 names", id="env too large"),
    pytest.param(InventoriesRequest, {"sidecars": {"1": "h"}, "timeout_seconds": 1},
                 "'sidecars.1' must be \"host:port\"", id="relayed address"),
    pytest.param(InventoriesRequest, {"sidecars": {}, "timeout_seconds": 0},
                 "'timeout_seconds' must be a number of seconds in (0, 10]", id="relay timeout"),
    pytest.param(InventoriesRequest,
                 {"sidecars": {str(r): "h:1" for r in range(257)}, "timeout_seconds": 1},
                 "'sidecars' must be at most 256 entries", id="relay batch"),
])
def test_bad_bodies_are_refused_naming_the_field(kind: Any, doc: Any, message: str) -> None:
    with pytest.raises(ValueError) as err:
        kind.from_json(doc)
    assert message in str(err.value)


def test_nested_fields_are_named_by_their_path() -> None:
    doc = INVENTORY.to_json()
    doc["local"][1]["complete"] = "yes"
    with pytest.raises(ValueError, match=r"/inventory answer: 'local\[1\]\.complete' must be "
                                         r"true or false, got 'yes'"):
        Inventory.from_json(doc)
    doc = INVENTORY.to_json()
    doc["sending"]["peers"]["1"]["acked_version"] = 1.5
    with pytest.raises(ValueError, match=r"'sending\.peers\.1\.acked_version' must be an "
                                         "integer"):
        Inventory.from_json(doc)
    doc = INVENTORY.to_json()
    del doc["placement"]
    with pytest.raises(ValueError, match="'placement' is required"):
        Inventory.from_json(doc)


def test_launcher_answers_are_checked_too() -> None:
    doc = STATUS.to_json() | {"state": "sleeping"}
    with pytest.raises(ValueError, match="'state' must be one of starting, held, running"):
        LauncherStatus.from_json(doc)
    with pytest.raises(ValueError, match="'result' must be one of restarted, already"):
        RestartAnswer.from_json(STATUS.to_json() | {"result": "maybe"})
    with pytest.raises(ValueError, match=r"'progress\.age_s' is required"):
        LauncherStatus.from_json(STATUS.to_json() | {"progress": {"step": 1, "unix": 2.0}})


def test_a_relayed_inventory_counts_only_under_its_own_rank_and_when_valid() -> None:
    doc = {"inventories": {"0": INVENTORY.to_json(), "3": INVENTORY.to_json(),
                           "4": {"job": "j"}}, "failed": {"5": "no answer"}}
    answer = InventoriesAnswer.from_json(doc)
    assert list(answer.inventories) == [0]
    assert "inventory of rank 0" in answer.failed[3]
    assert "invalid inventory" in answer.failed[4] and answer.failed[5] == "no answer"


def test_fetch_replicas_answer_tells_whether_every_rank_came() -> None:
    assert FetchReplicasAnswer((ReplicaFetch(2, 7, 1, ()),)).ok
    assert not FetchReplicasAnswer((ReplicaFetch(2, 7, 1, ()), ReplicaFetch(3, error="x"))).ok
    assert INVENTORY.complete_versions() == {7}
    assert [(c.rank, c.version) for c in INVENTORY.copies()] == [(0, 7), (0, 8), (2, 7)]


def test_an_inventory_names_the_shard_copies_it_holds_complete() -> None:
    assert INVENTORY.complete_copies() == {(0, 7), (2, 7)}  # its step 8 is still being written


def test_a_placement_is_the_same_when_it_holds_and_sends_to_the_same_ranks() -> None:
    assert PEERS.same_ranks(Peers({}, (2,), (1,)))
    assert not PEERS.same_ranks(Peers(PEERS.peers, (2,), (3,)))
    assert not PEERS.same_ranks(Peers(PEERS.peers, (), (1,)))
