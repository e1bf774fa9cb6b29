"""Fault matrix, part B: S3 gone while a persist is due, a node lost while it sends its
replica, and a whole zone lost at once.

Each case runs examples/train_gpt_zero3.py (DeepSpeed ZeRO-3, a tiny model) as a GeminiJob on
the local cluster, injects the fault with gemini_local (faults, the S3 gateway's pause), and
checks that training went on and that rank 0's per-step losses equal an uninterrupted run's.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from kubernetes import client

from gemini.control.client import ControlClient
from gemini_local import faults
from gemini_operator.core import naming
from gemini_operator.core.render import RenderConfig
from gemini_sidecar.s3 import JobIdentity, S3Store, committed_steps
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import (
    ARGS,
    _recovered_after,
    losses,
    newest_step,
    training_job,
)
from tests.fixtures.isolated_nodes import IsolatedNodes
from tests.fixtures.operator import OperatorThread
from tests.fixtures.s3 import create_credentials_secret, persistence_spec
from tests.fixtures.trainers import EXAMPLE, SharedReferences

# Each case takes 2-4 minutes on an idle 2-core machine; the limit leaves room for a busy one.
# Node-agent twin of a kubelet-node proof: `./dev long` only (tests/proofs.py).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(1200), pytest.mark.long]


@pytest.fixture(scope="module")
def reference(shared_references: SharedReferences) -> dict[int, str]:
    """Rank 0's losses of an uninterrupted 2-rank run on loopback (the recovery tests' ARGS;
    run once per session)."""
    return shared_references(2, ARGS)


def _sleep_args(seconds: float) -> list[str]:
    """ARGS with another --step-sleep (idle time changes no loss)."""
    return ["python", str(EXAMPLE), *ARGS[:-1], str(seconds)]


@pytest.fixture(scope="module")
def reference4(shared_references: SharedReferences) -> dict[int, str]:
    """Rank 0's losses of an uninterrupted 4-rank run on loopback."""
    return shared_references(4, ARGS)


def _wait_finished(jobs: Jobs, name: str, state: Path, timeout: float = 400) -> None:
    """Wait for Succeeded or Failed; on a timeout, say where each rank's trainer was."""
    try:
        wait_for(lambda: jobs.state(name) in ("Succeeded", "Failed"), timeout,
                 "the job to finish")
    except AssertionError as err:
        tails = []
        for path in sorted(state.glob(f"nodes/*/pods/{jobs.ns}_{name}-worker-*/**/trainer/*.log")):
            lines = [ln for ln in path.read_text(errors="replace").splitlines()
                     if ln.strip() and "WARNING" not in ln][-4:]
            tails.append(f"--- {path.relative_to(state)}\n" + "\n".join(lines))
        status = (jobs.get(name) or {}).get("status")
        raise AssertionError(f"{err}; status: {status}\n" + "\n".join(tails)) from None


def checkpoint(jobs: Jobs, name: str) -> dict[str, Any]:
    """The job's status.checkpoint (empty before the first report)."""
    return dict(((jobs.get(name) or {}).get("status") or {}).get("checkpoint") or {})


def request_persist(jobs: Jobs, name: str, value: str) -> None:
    """Ask for a persist now, as a user does: a new value of the annotation."""
    body = {"metadata": {"annotations": {"gemini.io/persist-requested": value}}}
    jobs.custom.patch_namespaced_custom_object(naming.GROUP, naming.VERSION, jobs.ns,
                                               naming.PLURAL, name, body)


def persisted_after(status: dict[str, Any], first: int) -> int | None:
    """The persisted step of a job's status.checkpoint once it is newer than `first` and no
    error is left, else None."""
    step = status.get("persistedStep")
    if step is None or step <= first or "persistError" in status:
        return None
    return int(step)


@pytest.mark.proves("s3-outage")
def test_s3_down_while_a_persist_is_due_keeps_training_and_persists_once_it_is_back(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str], s3_server: Any, s3_prefix: str,
) -> None:
    started = time.monotonic()
    jobs = Jobs(kube_api, job_namespace)
    endpoint = s3_server.endpoint
    create_credentials_secret(jobs.core, job_namespace, endpoint)
    prefix = s3_prefix.rstrip("/")
    job = training_job("s3down", 2)
    job["spec"]["template"]["command"] = _sleep_args(5.0)
    job["spec"]["persistence"] = persistence_spec(endpoint, prefix, 30)
    jobs.create(job)
    state = local_cluster.state_dir
    first = wait_for(lambda: checkpoint(jobs, "s3down").get("persistedStep"), 300,
                     "the first step persisted to S3")
    s3_server.pause()  # the gateway process ends: every S3 request is refused
    try:
        down_at = newest_step(state, job_namespace, "s3down-worker-0")
        request_persist(jobs, "s3down", "outage")
        error = wait_for(lambda: checkpoint(jobs, "s3down").get("persistError"), 120,
                         "status.checkpoint.persistError")
        # Training goes on without S3: a later step is trained while the gateway is down.
        wait_for(lambda: newest_step(state, job_namespace, "s3down-worker-0") > down_at, 60,
                 "a step trained while S3 is down")
        assert jobs.state("s3down") == "Running"
        assert checkpoint(jobs, "s3down")["persistedStep"] == first
    finally:
        s3_server.resume()
    print(f"persist failed with S3 down: {error}")
    assert error.startswith("step ") and "S3" in error, error
    warnings = [e for e in jobs.events("s3down") if e.reason == "PersistFailed"]
    assert warnings and warnings[0].type == "Warning", [e.reason for e in jobs.events("s3down")]
    # The request stays pending while it fails: the operator retries it once S3 is back.
    try:
        persisted = wait_for(lambda: persisted_after(checkpoint(jobs, "s3down"), first), 120,
                             "a later step persisted after S3 came back")
    except AssertionError as err:
        raise AssertionError(f"{err}; status: {jobs.get('s3down')['status']}") from None
    store = S3Store(s3_server.client(), endpoint.bucket, prefix, TransferConfig())
    owner = JobIdentity(job_namespace, "s3down", jobs.get("s3down")["metadata"]["uid"])
    assert persisted in committed_steps(store, owner)
    _wait_finished(jobs, "s3down", state)
    assert jobs.get("s3down")["status"]["state"] == "Succeeded"
    got, conflicts = losses(state, job_namespace, "s3down-worker-0")
    assert not conflicts
    assert got == reference
    assert {"PersistFailed", "PersistRecovered"} <= {e.reason for e in jobs.events("s3down")}
    jobs.delete("s3down")
    print(f"S3 outage case: persisted {first}, then {persisted} after the outage; "
          f"{time.monotonic() - started:.0f} s")


@pytest.mark.proves("zone-loss")
def test_losing_a_whole_zone_recovers_every_rank_from_its_peer_in_the_other_zone(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference4: dict[int, str], isolated_nodes: IsolatedNodes,
) -> None:
    started = time.monotonic()
    zones = {zone: [isolated_nodes.add(zone, f"rack-{i}") for i in range(2)]
             for zone in ("zone-a", "zone-b")}
    jobs = Jobs(kube_api, job_namespace)
    job = training_job("zones", 4)
    job["spec"]["template"]["command"] = _sleep_args(1.0)
    job["spec"]["checkpoint"]["peerEncryption"] = True  # replicas and peer fetches encrypted
    jobs.create(job)
    # The full status: the session's operator keeps the per-rank maps in a ConfigMap.
    placement = wait_for(lambda: jobs.status("zones").get("placement"), 240,
                         "the placement of the 4 workers")
    zone_of = isolated_nodes.zone_of
    groups = [{zone_of[placement["nodes"][str(r)]] for r in g} for g in placement["groups"]]
    assert groups == [{"zone-a", "zone-b"}] * 2, placement  # each group spans both zones
    # Spares in the surviving zone, for the two ranks that go with zone-b.
    spares = [isolated_nodes.add("zone-a") for _ in range(2)]
    state = local_cluster.state_dir
    wait_for(lambda: (jobs.get("zones") or {}).get("status", {}).get("launch"), 120,
             "the operator to start training")
    wait_for(lambda: newest_step(state, job_namespace, "zones-worker-0") >= 4, 300,
             "training to reach step 4")
    lost_ranks = sorted(int(r) for r, n in placement["nodes"].items()
                        if zone_of[n] == "zone-b")
    before = jobs.get("zones")["status"]
    for node in zones["zone-b"]:
        faults.lose_node(state, node)
    lost_at = time.monotonic()
    last = wait_for(lambda: _recovered_after(jobs, "zones", before), 300,
                    "the recovery to finish")
    print(f"zone-loss recovery: {time.monotonic() - lost_at:.1f} s after the loss, {last}")
    assert last["cause"] == "hardware" and last["source"] == "Peers", last
    # The survivors' training processes may die first (their collectives broke): also failed.
    assert set(lost_ranks) <= set(last["failedRanks"]), last
    assert last["stepsLost"] <= 1, last
    pods = [p for p in jobs.pods("zones") if not p.metadata.deletion_timestamp]
    nodes = {p.metadata.name: p.spec.node_name for p in pods}
    assert {nodes[f"zones-worker-{r}"] for r in lost_ranks} <= set(spares), nodes
    assert {_env(p, naming.SIDECAR_CONTAINER, "GEMINI_PEER_ENCRYPTION") for p in pods} == {"on"}
    _wait_finished(jobs, "zones", state)
    assert jobs.get("zones")["status"]["state"] == "Succeeded", jobs.get("zones")["status"]
    got, conflicts = losses(state, job_namespace, "zones-worker-0")
    assert not conflicts
    assert got == reference4
    jobs.delete("zones")
    print(f"zone-loss case: {time.monotonic() - started:.0f} s")


def _env(pod: Any, container: str, name: str) -> str | None:
    """The value of `name` in the environment of `container` (native sidecars included)."""
    for c in [*(pod.spec.init_containers or []), *pod.spec.containers]:
        if c.name == container:
            return next((e.value for e in c.env or [] if e.name == name), None)
    return None


def _sidecar_pid(state: Path, namespace: str, pod: str) -> int:
    pattern = f"nodes/*/pods/{namespace}_{pod}_*/containers/{naming.SIDECAR_CONTAINER}.pid"
    [pid_file] = state.glob(pattern)
    return int(pid_file.read_text().split()[0])


def sidecar_inventory(ip: str, token: str) -> dict[str, Any]:
    # signed with the job token (issue 45: no token on the wire)
    return ControlClient(ip, RenderConfig().sidecar_api_port, token,
                         timeout=5).call_json("/inventory")


def sending_to(doc: dict[str, Any], rank: int) -> int:
    """The version the sidecar of `doc` is sending to `rank` now (-1: none)."""
    peer = doc["sending"]["peers"].get(str(rank)) or {}
    return int(peer.get("sending_version", -1))


def stuck_sending(ip: str, token: str, rank: int) -> int | None:
    """The version the sidecar at `ip` has been sending to `rank` for half a second (a send
    normally takes milliseconds), or None."""
    first = sending_to(sidecar_inventory(ip, token), rank)
    if first < 0:
        return None
    time.sleep(0.5)
    return first if sending_to(sidecar_inventory(ip, token), rank) == first else None


def begun(doc: dict[str, Any], rank: int, version: int) -> list[dict[str, Any]]:
    """The replicas of `rank`'s `version` the sidecar of `doc` has taken in (complete or not)."""
    return [r for r in doc["replicas"] if r["rank"] == rank and r["version"] == version]


@pytest.mark.proves("loss-mid-replication")
def test_a_node_lost_while_sending_its_replica_is_recovered_from_the_last_complete_one(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str], isolated_nodes: IsolatedNodes,
) -> None:
    started = time.monotonic()
    for _ in range(3):  # rank 0, rank 1, and the spare rank 1's replacement will run on
        isolated_nodes.add("zone-0")
    jobs = Jobs(kube_api, job_namespace)
    job = training_job("midrep", 2)
    job["spec"]["template"]["command"] = _sleep_args(1.0)
    jobs.create(job)
    state = local_cluster.state_dir
    wait_for(lambda: (jobs.get("midrep") or {}).get("status", {}).get("launch"), 180,
             "the operator to start training")
    wait_for(lambda: newest_step(state, job_namespace, "midrep-worker-0") >= 3, 300,
             "training to reach step 3")
    pods = {p.metadata.name: p for p in jobs.pods("midrep")}
    secret = jobs.core.read_namespaced_secret(naming.secret_name("midrep"), job_namespace)
    token = base64.b64decode(str((secret.data or {})[naming.SECRET_TOKEN_KEY])).decode()
    receiver, sender = pods["midrep-worker-0"], pods["midrep-worker-1"]
    # Freeze rank 0's sidecar, so the next version rank 1 sends stays in flight: sent, but
    # neither received nor acknowledged. Then power rank 1's node off in the middle of it.
    frozen = _sidecar_pid(state, job_namespace, "midrep-worker-0")
    before = jobs.get("midrep")["status"]
    os.killpg(frozen, signal.SIGSTOP)
    try:
        in_flight = wait_for(lambda: stuck_sending(sender.status.pod_ip, token, 0), 60,
                             "rank 1 to be stuck sending a version to rank 0")
        faults.lose_node(state, sender.spec.node_name)
    finally:
        os.killpg(frozen, signal.SIGCONT)
    half = wait_for(lambda: begun(sidecar_inventory(receiver.status.pod_ip, token), 1, in_flight),
                    30,
                    f"rank 0's sidecar to take in the begun version {in_flight}")
    print(f"rank 1's version {in_flight} on rank 0 when rank 1's node went: {half}")
    # Begun, never complete: its bytes may all have reached rank 0's socket before rank 1's
    # node went (a quarter MiB fits in the buffers), but not the end that completes it.
    assert not half[0]["complete"], half
    last = wait_for(lambda: _recovered_after(jobs, "midrep", before), 300,
                    "the recovery to finish")
    print(f"mid-replication recovery: {last}")
    assert last["cause"] == "hardware" and last["source"] == "Peers", last
    assert last["restoredStep"] < in_flight, last  # never the half-received version
    assert last["stepsLost"] <= 1, last
    _wait_finished(jobs, "midrep", state)
    assert jobs.get("midrep")["status"]["state"] == "Succeeded", jobs.get("midrep")["status"]
    got, conflicts = losses(state, job_namespace, "midrep-worker-0")
    assert not conflicts
    assert got == reference
    jobs.delete("midrep")
    print(f"mid-replication case: {time.monotonic() - started:.0f} s")
