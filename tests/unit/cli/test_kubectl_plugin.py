"""`kubectl gemini`: the pure reports (status, plan) and the argument parsing, table-driven.

The cluster in these tables is the local cluster's shape: node-0..node-3, zone-0 holds
node-0/1 and zone-1 node-2/3, rack-0 holds node-0/2 and rack-1 node-1/3 (rack names repeat
across zones). Four ranks, m=2, domain-aware placement computed by the real placement code:
ranks 0 and 2 hold each other's shards, and so do ranks 1 and 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gemini.domain.placement import Machine, domain_aware_placement
from gemini_cli import CliError
from gemini_cli.kubectl_objects import job_info, node_infos, worker_infos
from gemini_cli.kubectl_plan import FailureRequest, plan_report, render_plan
from gemini_cli.kubectl_plugin import build_parser
from gemini_cli.kubectl_status import render_status, replica_coverage, status_report

NODES = {f"node-{i}": (f"zone-{i // 2}", f"rack-{i % 2}") for i in range(4)}


def make_node(name: str, zone: str = "", rack: str = "", ready: str | None = "True",
              unschedulable: bool = False) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    if zone:
        labels["topology.kubernetes.io/zone"] = zone
    if rack:
        labels["topology.gemini.io/rack"] = rack
    conditions = [] if ready is None else [{"type": "Ready", "status": ready}]
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"unschedulable": unschedulable}, "status": {"conditions": conditions}}


def make_pod(job: str, rank: int, node: str, attempt: int = 0, phase: str = "Running",
             ready: bool = True, restarts: int = 0, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": f"{job}-worker-{rank}",
        "labels": {"gemini.io/job-name": job, "gemini.io/role": "worker",
                   "gemini.io/rank": str(rank), "gemini.io/restart-attempt": str(attempt)},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T18:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "initContainerStatuses": [{"name": "gemini-sidecar", "restartCount": 0}],
            "containerStatuses": [{"name": "trainer", "restartCount": restarts}],
        },
    }


@dataclass
class JobBuilder:
    """`JobBuilder().with_placement().obj()`: a GeminiJob as the API serves it."""

    name: str = "train"
    ranks: int = 4
    replicas: int = 2
    status: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)

    def with_placement(self, on: dict[int, str] | None = None) -> JobBuilder:
        on = on or {r: f"node-{r}" for r in range(self.ranks)}
        machines = [Machine(r, n, *NODES.get(n, ("", ""))) for r, n in on.items()]
        doc = domain_aware_placement(machines, self.replicas).to_dict()
        doc["restartAttempt"] = 0
        doc["nodes"] = {str(r): n for r, n in on.items()}
        self.status["placement"] = doc
        return self

    def with_steps(self, memory: int | None, s3: int | None) -> JobBuilder:
        checkpoint = {"inMemoryStep": memory, "persistedStep": s3}
        self.status["checkpoint"] = {k: v for k, v in checkpoint.items() if v is not None}
        return self

    def with_status(self, **fields: Any) -> JobBuilder:
        self.status.update(fields)
        return self

    def with_spec(self, **fields: Any) -> JobBuilder:
        self.spec.update(fields)
        return self

    def obj(self) -> dict[str, Any]:
        return {
            "metadata": {"name": self.name, "namespace": "ml"},
            "spec": {"numNodes": self.ranks, "checkpoint": {"replicas": self.replicas},
                     **self.spec},
            "status": {"state": "Running", **self.status},
        }


def cluster(*, down: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> dict[str, Any]:
    nodes = [make_node(n, z, r, "False" if n in down else "True") for n, (z, r) in NODES.items()]
    nodes += [make_node(n, "zone-0", "rack-0") for n in extra]
    return node_infos(nodes)


def pods(job: str = "train", on: dict[int, str] | None = None) -> dict[int, Any]:
    on = on or {r: f"node-{r}" for r in range(4)}
    return worker_infos([make_pod(job, r, n) for r, n in on.items()])


# --- plan: what happens if these failed now -----------------------------------------------------

@dataclass(frozen=True)
class PlanCase:
    name: str
    request: FailureRequest
    memory_step: int | None = 40
    s3_step: int | None = 30
    down: tuple[str, ...] = ()
    extra_nodes: tuple[str, ...] = ()
    mode: str = "memory"
    version: int | None = 40
    replaced: tuple[int, ...] = ()
    peer_sources: dict[int, int] = field(default_factory=dict)  # rank -> holder rank
    candidates: tuple[str, ...] = ()
    note: str = ""


PLAN_CASES = [
    PlanCase("losing one node replaces its rank, which fetches its shard from its group peer",
             FailureRequest(nodes=("node-0",)), replaced=(0,), peer_sources={0: 2}),
    PlanCase("losing a whole zone is survivable because every group spans both zones",
             FailureRequest(zones=("zone-0",)), replaced=(0, 1), peer_sources={0: 2, 1: 3}),
    PlanCase("a rack named with its zone fails only that zone's rack",
             FailureRequest(racks=("zone-1/rack-0",)), replaced=(2,), peer_sources={2: 0}),
    PlanCase("losing both holders of a shard restores every rank from S3",
             FailureRequest(nodes=("node-0", "node-2")), mode="s3", version=30,
             replaced=(0, 2)),
    PlanCase("losing both holders of a shard with nothing in S3 is unrecoverable",
             FailureRequest(nodes=("node-1", "node-3")), s3_step=None, mode="unrecoverable",
             version=None, replaced=(1, 3)),
    PlanCase("a node that is already NotReady counts as lost with the named one",
             FailureRequest(nodes=("node-1",)), down=("node-3",), mode="s3", version=30,
             replaced=(1, 3)),
    PlanCase("S3 is used when it holds a newer step than memory",
             FailureRequest(nodes=("node-0",)), memory_step=20, s3_step=30, mode="s3",
             version=30, replaced=(0,)),
    PlanCase("no step in memory yet means S3, and the plan says so",
             FailureRequest(nodes=("node-0",)), memory_step=None, mode="s3", version=30,
             replaced=(0,), note="no step is complete in memory yet"),
    PlanCase("a free Ready node is offered for the replacement pod",
             FailureRequest(nodes=("node-3",)), extra_nodes=("spare-4",), replaced=(3,),
             peer_sources={3: 1}, candidates=("spare-4",)),
    PlanCase("a node that runs no worker changes nothing, and the plan says so",
             FailureRequest(nodes=("spare-4",)), extra_nodes=("spare-4",),
             note="node spare-4 runs no worker of train"),
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: c.name)
def test_plan_scenario(case: PlanCase) -> None:
    job = job_info(JobBuilder().with_placement().with_steps(case.memory_step, case.s3_step).obj())
    report = plan_report(job, pods(), cluster(down=case.down, extra=case.extra_nodes),
                         case.request)
    scenario = report["scenario"]
    assert scenario["plan"]["mode"] == case.mode
    assert scenario["plan"]["version"] == case.version
    assert tuple(scenario["plan"]["replaceRanks"]) == case.replaced
    assert scenario["s3Needed"] == (case.mode == "s3")
    rows = {r["rank"]: r for r in scenario["ranks"]}
    for rank, row in rows.items():
        assert row["action"] == ("replace" if rank in case.replaced else "restart in place")
        if case.mode == "memory":
            expected = "peer" if rank in case.peer_sources else "local"
            assert row["source"] == expected, rank
    for rank, holder in case.peer_sources.items():
        assert rows[rank]["from"] == f"rank {holder} on node-{holder}"
        assert rows[rank]["refetch"] == [holder]  # the replacement holds its peer's copy again
    if case.replaced:
        assert tuple(scenario["replacementCandidates"]) == case.candidates
    if case.note:
        assert any(case.note in n for n in scenario["notes"]), scenario["notes"]
    text = render_plan(report)
    assert ("S3 IS NEEDED" in text) == (case.mode == "s3")
    assert ("UNRECOVERABLE" in text) == (case.mode == "unrecoverable")


@dataclass(frozen=True)
class PlanError:
    name: str
    job: JobBuilder
    request: FailureRequest
    message: str


PLAN_ERRORS = [
    PlanError("an unknown node is refused with the job's nodes listed",
              JobBuilder().with_placement(), FailureRequest(nodes=("node-9",)),
              "unknown node 'node-9'"),
    PlanError("an unknown zone is refused with the cluster's zones listed",
              JobBuilder().with_placement(), FailureRequest(zones=("zone-7",)),
              "the cluster's zones are zone-0, zone-1"),
    PlanError("a rack name found in two zones must be qualified with its zone",
              JobBuilder().with_placement(), FailureRequest(racks=("rack-0",)),
              "name one as ZONE/RACK"),
    PlanError("a job without a placement in status says the operator has not published one",
              JobBuilder(), FailureRequest(nodes=("node-0",)), "has no placement yet"),
    PlanError("a suspended job has nothing in memory to plan with",
              JobBuilder().with_placement().with_spec(suspend=True),
              FailureRequest(nodes=("node-0",)), "is suspended"),
    PlanError("a finished job has nothing to plan",
              JobBuilder().with_placement().with_status(state="Succeeded"),
              FailureRequest(), "has finished"),
]


@pytest.mark.parametrize("case", PLAN_ERRORS, ids=lambda c: c.name)
def test_plan_refuses(case: PlanError) -> None:
    with pytest.raises(CliError, match=case.message):
        plan_report(job_info(case.job.obj()), pods(), cluster(), case.request)


def test_random_failure_probabilities_use_the_jobs_holder_sets() -> None:
    # Holder sets {0,2} and {1,3}: 2 of the 6 node pairs lose a shard; every 3 nodes do.
    job = job_info(JobBuilder().with_placement().with_steps(5, None).obj())
    report = plan_report(job, pods(), cluster(), FailureRequest(), failures=4)
    assert "scenario" not in report
    table = {r["failures"]: r["exact"] for r in report["randomFailures"]}
    assert table == {1: "1/1", 2: "2/3", 3: "0/1", 4: "0/1"}


def test_domain_resilience_reads_the_live_labels() -> None:
    job = job_info(JobBuilder().with_placement().obj())
    resilience = plan_report(job, pods(), cluster(), FailureRequest())["domainFailures"]
    assert resilience["zone"] == {"labelled": True, "mostHoldersInOne": 1, "survivesAnyOne": True}
    assert resilience["rack"]["survivesAnyOne"]  # rack-0 of zone-0 is not rack-0 of zone-1
    unlabelled = node_infos([make_node(n) for n in NODES])
    resilience = plan_report(job, pods(), unlabelled, FailureRequest())["domainFailures"]
    assert resilience["zone"]["labelled"] is False
    assert "any one zone: unknown" in render_plan(
        plan_report(job, pods(), unlabelled, FailureRequest()))


def test_plan_follows_a_rank_that_moved_to_another_node() -> None:
    # Rank 0 was replaced onto spare-4 after the placement was computed: failing node-0 now
    # hits nothing, failing spare-4 hits rank 0.
    job = job_info(JobBuilder().with_placement().with_steps(40, None).obj())
    moved = pods(on={0: "spare-4", 1: "node-1", 2: "node-2", 3: "node-3"})
    nodes = cluster(extra=("spare-4",))
    assert plan_report(job, moved, nodes, FailureRequest(nodes=("spare-4",))
                       )["scenario"]["failedRanks"] == [0]
    assert plan_report(job, moved, nodes, FailureRequest(nodes=("node-0",))
                       )["scenario"]["failedRanks"] == []


# --- status ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CoverageCase:
    name: str
    checkpoint: dict[str, Any]
    known: bool
    fraction: float | None = None


COVERAGE_CASES = [
    CoverageCase("coverage published as counts", {"replicaCoverage": {"complete": 3, "total": 4}},
                 True, 0.75),
    CoverageCase("coverage published as a fraction", {"replicaCoverage": 1.0}, True, 1.0),
    CoverageCase("no coverage in status is unknown, not zero", {"inMemoryStep": 3}, False),
    CoverageCase("an empty coverage document is unknown", {"replicaCoverage": {"total": 0}},
                 False),
]


@pytest.mark.parametrize("case", COVERAGE_CASES, ids=lambda c: c.name)
def test_replica_coverage(case: CoverageCase) -> None:
    coverage = replica_coverage({"checkpoint": case.checkpoint})
    assert coverage["known"] is case.known
    assert coverage.get("fraction") == case.fraction


def test_status_report_joins_pods_nodes_placement_and_recoveries() -> None:
    last = {"cause": "NodeLost", "source": "Peers", "failedRanks": [2], "restoredStep": 41,
            "stepsLost": 1, "startTime": "2026-11-29T18:00:00Z",
            "completionTime": "2026-11-29T18:00:04Z", "durationMilliseconds": 4200}
    job = job_info(JobBuilder().with_placement().with_steps(42, 30).with_status(
        restarts=1, lastRecovery=last,
        conditions=[{"type": "Running", "status": "True", "reason": "AllWorkersReady",
                     "message": "all 4 workers are ready"}]).obj())
    raw_pods = [make_pod("train", r, f"node-{r}", restarts=r) for r in range(4)]
    raw_pods[2] = make_pod("train", 2, "node-3", attempt=1)  # replaced, now beside rank 3
    events = [
        {"type": "Normal", "reason": "Created", "message": "created 4 workers",
         "lastTimestamp": "2026-11-29T17:00:00Z"},
        {"type": "Warning", "reason": "RecoveryNeeded", "message": "node-2 lost; peers",
         "lastTimestamp": "2026-11-29T18:00:00Z"},
        {"type": "Normal", "reason": "RecoveryFinished", "message": "restored step 41",
         "lastTimestamp": "2026-11-29T18:00:04Z"},
    ]
    report = status_report(job, worker_infos(raw_pods), cluster(), events)
    rows = {w["rank"]: w for w in report["workers"]}
    assert rows[1] == {"rank": 1, "pod": "train-worker-1", "node": "node-1", "zone": "zone-0",
                       "rack": "rack-1", "nodeReady": "True", "phase": "Running", "ready": True,
                       "restarts": 1, "attempt": 0, "group": 1}
    assert rows[2]["node"] == "node-3" and rows[2]["group"] == 0
    assert report["placement"]["moved"] == {"2": {"placedOn": "node-2", "now": "node-3"}}
    assert report["placement"]["groups"][0]["nodes"] == ["node-0", "node-3"]
    assert report["checkpoint"]["inMemoryStep"] == 42
    assert report["checkpoint"]["persistedStep"] == 30
    assert report["recoveries"]["last"]["source"] == "Peers"
    assert [e["reason"] for e in report["recoveries"]["events"]] == [
        "RecoveryNeeded", "RecoveryFinished"]
    text = render_status(report)
    for expected in ("NodeLost of ranks 2", "from Peers", "took 4.2 s", "AllWorkersReady",
                     "rank 2 moved from node-2 to node-3", "replica coverage (all m copies):"
                     "   unknown", "newest step in S3:                 30"):
        assert expected in text, expected


def test_status_without_placement_or_pods_says_what_is_missing() -> None:
    report = status_report(job_info(JobBuilder().obj()), {}, cluster())
    assert report["placement"] is None
    assert report["missingRanks"] == [0, 1, 2, 3]
    text = render_status(report)
    assert "not computed yet" in text
    assert "ranks without a pod: 0, 1, 2, 3" in text
    assert "none yet (is the operator running?)" in text


@pytest.mark.parametrize(
    ("name", "raw", "expected_node", "expected_attempt"),
    [
        ("the newest restart attempt wins", [make_pod("j", 0, "node-0", attempt=0),
                                             make_pod("j", 0, "node-1", attempt=1)], "node-1", 1),
        ("a live pod wins over a terminating one of the same attempt",
         [make_pod("j", 0, "node-0", deleting=True), make_pod("j", 0, "node-2")], "node-2", 0),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else "",
)
def test_worker_infos_pick_the_current_pod(name: str, raw: list[dict[str, Any]],
                                           expected_node: str, expected_attempt: int) -> None:
    worker = worker_infos(raw)[0]
    assert (worker.node, worker.attempt) == (expected_node, expected_attempt)


def test_pods_without_rank_labels_are_ignored() -> None:
    stray = make_pod("j", 0, "node-0")
    del stray["metadata"]["labels"]["gemini.io/rank"]
    assert worker_infos([stray]) == {}


# --- arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("argv", "namespace", "kubeconfig"),
    [
        (["status", "j"], None, None),
        (["status", "j", "-n", "ml"], "ml", None),
        (["-n", "ml", "--kubeconfig", "/k", "status", "j"], "ml", "/k"),
        (["--kubeconfig", "/k", "plan", "j", "--namespace", "ml"], "ml", "/k"),
    ],
)
def test_cluster_flags_work_before_and_after_the_subcommand(
        argv: list[str], namespace: str | None, kubeconfig: str | None) -> None:
    args = build_parser().parse_args(argv)
    assert (args.namespace, args.kubeconfig, args.job) == (namespace, kubeconfig, "j")


def test_plan_flags_repeat() -> None:
    args = build_parser().parse_args(
        ["plan", "j", "--fail-node", "a", "--fail-node", "b", "--fail-zone", "z", "-o", "json"])
    assert (args.fail_node, args.fail_zone, args.fail_rack, args.output) == (
        ["a", "b"], ["z"], [], "json")
