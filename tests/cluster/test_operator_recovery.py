"""The operator recovers a real DeepSpeed ZeRO-3 job on the local cluster, and the per-step
losses equal an uninterrupted run's.

A software failure (the trainer container killed) is repaired in place: every launcher starts
a new epoch from the newest step in local memory, no pod is recreated. Logs are read from the
node agents' files (one per container restart), so every epoch's lines are seen.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gemini_local import faults
from gemini_local.cluster import KUBELET_NODES
from gemini_local.kubelet.node import POD_LOGS
from tests.cluster.test_operator import Jobs, wait_for
from tests.fixtures.operator import OperatorThread
from tests.fixtures.s3 import create_credentials_secret, persistence_spec
from tests.fixtures.trainers import EXAMPLE, SharedReferences
from tests.unit.operator.builders import make_job

# Node-agent twins of kubelet-node proofs (and the operator killed in each phase, a count):
# `./dev long` only (tests/proofs.py).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.long]

STEPS = 12
ARGS = ["--engine", "deepspeed", "--steps", str(STEPS), "--layers", "1", "--d-model", "32",
        "--step-sleep", "0.3"]
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")
ENV = [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]


def training_job(name: str, workers: int) -> dict[str, Any]:
    return (make_job(name).with_nodes(workers).with_replicas(2)
            .set("template.command", ["python", str(EXAMPLE), *ARGS])
            .set("template.env", ENV)
            .set("failurePolicy.maxRestarts", 5)
            .obj())


def log_texts(state_dir: Path, namespace: str, pod: str) -> list[str]:
    """Every trainer log of the pod (all its restarts, every pod of that name, on node agents
    and real kubelets), oldest first. A log can vanish while it is read: a healed node's agent
    deletes its replaced pod's files."""
    dated = []
    prefix = f"{namespace}_{pod}_"
    for path in [*_trainer_logs(state_dir, prefix), *_kubelet_trainer_logs(state_dir, prefix)]:
        try:
            mtime, text = path.stat().st_mtime, path.read_text(errors="replace")
        except FileNotFoundError:
            continue
        dated.append((mtime, cri_text(text) if KUBELET_NODES in path.parts else text))
    return [text for _, text in sorted(dated, key=lambda item: item[0])]


def _trainer_logs(state_dir: Path, pod_prefix: str) -> Iterator[Path]:
    """nodes/*/pods/<pod_prefix>*/**/trainer/*.log. Not Path.glob: its `**` walk raises when
    a directory vanishes under it, and os.walk skips one."""
    nodes = state_dir / "nodes"
    for root, dirs, files in os.walk(nodes):
        depth = len(Path(root).relative_to(nodes).parts)
        if depth == 1:
            dirs[:] = [d for d in dirs if d == "pods"]
        elif depth == 2:
            dirs[:] = [d for d in dirs if d.startswith(pod_prefix)]
        elif Path(root).name == "trainer":
            yield from (Path(root, f) for f in files if f.endswith(".log"))


def _kubelet_trainer_logs(state_dir: Path, pod_prefix: str) -> Iterator[Path]:
    """kubelet-nodes/*/kubelet/pod-logs/<pod_prefix>*/trainer/*.log: a lost node's stay."""
    for node in (state_dir / KUBELET_NODES).glob("n*"):
        logs = node / POD_LOGS
        for pod in os.listdir(logs) if logs.is_dir() else ():
            if pod.startswith(pod_prefix):
                with contextlib.suppress(FileNotFoundError):
                    yield from (logs / pod / "trainer" / f
                                for f in os.listdir(logs / pod / "trainer") if f.endswith(".log"))


def cri_text(text: str) -> str:
    """What the container wrote, from a kubelet's log (CRI format: `<time> <stream> <F|P>
    <text>` per line, P for a part of a longer line)."""
    out, part = [], ""
    whole = text.split("\n")[:-1]  # the last, unless empty, is still being written
    for line in whole:
        fields = line.split(" ", 3)
        if len(fields) < 3 or fields[2] not in ("F", "P"):
            continue  # a line being written
        part += fields[3] if len(fields) > 3 else ""
        if fields[2] == "F":
            out.append(part)
            part = ""
    return "\n".join(out) + ("\n" if out else "")


def losses(state_dir: Path, namespace: str, pod: str) -> tuple[dict[int, str], list[str]]:
    """step -> loss (the last value printed for it), and every conflicting re-print."""
    seen: dict[int, str] = {}
    conflicts = []
    for text in log_texts(state_dir, namespace, pod):
        for line in text.splitlines():
            match = STEP_LINE.match(line.strip())
            if match:
                step, loss = int(match.group(1)), match.group(2)
                if step in seen and seen[step] != loss:
                    conflicts.append(f"step {step}: {seen[step]} then {loss}")
                seen[step] = loss
    return seen, conflicts


def newest_step(state_dir: Path, namespace: str, pod: str) -> int:
    return max(losses(state_dir, namespace, pod)[0], default=0)


@pytest.fixture(scope="module")
def reference(shared_references: SharedReferences) -> dict[int, str]:
    """Rank 0's losses of an uninterrupted run on loopback (same arguments but the idle time
    per step, which changes no loss; same world), run once per session."""
    return shared_references(2, ARGS)


@pytest.mark.proves("trainer-crash", "trainer-container-kill")
def test_a_killed_trainer_is_restarted_in_place_from_local_memory(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str],
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    jobs.create(training_job("soft", 2))
    wait_for(lambda: (jobs.get("soft") or {}).get("status", {}).get("launch"), 120,
             "the operator to start training")
    state = local_cluster.state_dir
    wait_for(lambda: newest_step(state, job_namespace, "soft-worker-0") >= 4, 240,
             "training to reach step 4")
    uids = {p.metadata.name: p.metadata.uid for p in jobs.pods("soft")}
    before = jobs.get("soft")["status"]
    faults.kill_container(state, job_namespace, "soft-worker-1", "trainer")
    killed_at = time.monotonic()
    last = wait_for(lambda: _recovered_after(jobs, "soft", before), 120,
                    "the recovery to finish")
    print(f"in-place recovery: {time.monotonic() - killed_at:.1f} s, {last}")
    assert last["source"] == "Local" and last["cause"] == "software", last
    wait_for(lambda: jobs.state("soft") in ("Succeeded", "Failed"), 300, "the job to finish")
    job = jobs.get("soft")
    assert job["status"]["state"] == "Succeeded", job["status"]
    assert job["status"]["restarts"] > before["restarts"]
    assert {p.metadata.name: p.metadata.uid for p in jobs.pods("soft")} == uids
    # The survivor restarted inside its training process (gemini_trainer.run): no container
    # restart, its own log says so, and it went on from the restored step + 1.
    assert trainer_restarts({p.metadata.name: p for p in jobs.pods("soft")}["soft-worker-0"]) == 0
    text = "\n".join(log_texts(state, job_namespace, "soft-worker-0"))
    at = text.find(f"gemini: in-process restart: epoch {last['epoch']} ")
    story = [line for line in text.splitlines() if "launcher" in line or "gemini:" in line]
    assert at >= 0, "rank 0 did not restart in process:\n" + "\n".join(story[-40:])
    resumed = re.search(r"^restored step (\d+) .*\n(?:.*\n)*?step (\d+) loss", text[at:], re.M)
    assert resumed and int(resumed.group(1)) == int(last["restoredStep"])
    assert int(resumed.group(2)) == int(last["restoredStep"]) + 1
    got, conflicts = losses(state, job_namespace, "soft-worker-0")
    assert not conflicts
    assert got == reference
    reasons = {e.reason for e in jobs.events("soft")}
    assert {"TrainingStarted", "RecoveryNeeded", "RecoveryFinished"} <= reasons
    jobs.delete("soft")


def trainer_restarts(pod: Any) -> int:
    return sum(c.restart_count for c in (pod.status.container_statuses or ())
               if c.name == "trainer")


def _recovered_after(jobs: Jobs, name: str, before: dict[str, Any]) -> Any:
    """status.lastRecovery of a recovery newer than the launch epoch in `before`."""
    last = ((jobs.get(name) or {}).get("status") or {}).get("lastRecovery")
    return last if last and last["epoch"] > before["launch"]["epoch"] else None


def _lose_rank_one_node(local_cluster: Any, jobs: Jobs, namespace: str, name: str
                        ) -> tuple[str, str, float, dict[str, Any]]:
    """Train to step 4, add a spare, power off rank 1's node; (node, old uid, when)."""
    state = local_cluster.state_dir
    wait_for(lambda: (jobs.get(name) or {}).get("status", {}).get("launch"), 120,
             "the operator to start training")
    wait_for(lambda: newest_step(state, namespace, f"{name}-worker-0") >= 4, 240,
             "training to reach step 4")
    local_cluster.add_spare()
    old = {p.metadata.name: p for p in jobs.pods(name)}[f"{name}-worker-1"]
    before = jobs.get(name)["status"]
    faults.lose_node(state, old.spec.node_name)
    return str(old.spec.node_name), str(old.metadata.uid), time.monotonic(), before


def _assert_recovered_from_peers(jobs: Jobs, namespace: str, name: str, state: Path,
                                 lost_node: str, old_uid: str, reference: dict[int, str],
                                 before: dict[str, Any]) -> dict[str, Any]:
    last = wait_for(lambda: _recovered_after(jobs, name, before), 240,
                    "the recovery to finish")
    assert last["cause"] == "hardware" and last["source"] == "Peers", last
    new = {p.metadata.name: p for p in jobs.pods(name)}[f"{name}-worker-1"]
    assert new.metadata.uid != old_uid and new.spec.node_name != lost_node
    wait_for(lambda: jobs.state(name) in ("Succeeded", "Failed"), 300, "the job to finish")
    job = jobs.get(name)
    assert job["status"]["state"] == "Succeeded", job["status"]
    got, conflicts = losses(state, namespace, f"{name}-worker-0")
    assert not conflicts
    assert got == reference
    return dict(last)


@pytest.mark.proves("node-loss")
def test_a_lost_node_gets_one_replacement_pod_that_fetches_its_shard_from_peers(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str],
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    jobs.create(training_job("hard", 2))
    lost, old_uid, when, before = _lose_rank_one_node(local_cluster, jobs, job_namespace,
                                                      "hard")
    rank0_uid = {p.metadata.name: p.metadata.uid for p in jobs.pods("hard")}["hard-worker-0"]
    last = _assert_recovered_from_peers(jobs, job_namespace, "hard", local_cluster.state_dir,
                                        lost, old_uid, reference, before)
    print(f"node-loss recovery: {time.monotonic() - when:.1f} s after the loss, {last}")
    assert {p.metadata.name: p.metadata.uid for p in jobs.pods("hard")}["hard-worker-0"] == (
        rank0_uid)  # only the lost rank got a new pod
    # Found by the operator from the pods' silence, before the node controller's NotReady
    # (its grace period here is 8 s; 40 s or more on stock settings): silence.py.
    assert f"node {lost} does not answer" in last["message"], last["message"]
    # It did not wait for it (a plan made again counts from the start, as before it).
    before_the_plan = last["breakdown"]["planning"] + last["breakdown"].get("superseded", 0)
    assert before_the_plan < 3.0, last["breakdown"]
    jobs.delete("hard")


class PhaseTrap:
    """Freezes an operator right after it recorded `phase` in status.recovery, as if it
    crashed there: the phase is in the cluster, nothing after it was done or recorded."""

    def __init__(self, operator: OperatorThread, phase: str) -> None:
        self.phase = phase
        self.reached = threading.Event()
        self._release = threading.Event()
        # Every status patch of that operator goes out through its one StatusSender.
        self._sender = operator.runtime.reconciler.status
        self._write = self._sender.send
        self._sender.send = self._trapped

    def _trapped(self, job: Any, patch: Any) -> None:
        if self.reached.is_set():
            raise RuntimeError("this operator is stopped by the test")
        self._write(job, patch)
        if (patch.get("recovery") or {}).get("phase") == self.phase:
            self.reached.set()
            self._release.wait(300)
            raise RuntimeError("this operator is stopped by the test")

    def release(self) -> None:
        """Let the frozen reconcile fail; once tripped, this operator records nothing more
        until it is replaced. A trap never reached is taken out (the test failed before the
        restart: the session's operator must go on working)."""
        if not self.reached.is_set():
            self._sender.send = self._write
        self._release.set()


@pytest.mark.parametrize("phase", ["Planning", "Replacing", "Fetching"])
@pytest.mark.proves("operator-killed-mid-recovery")
def test_an_operator_restarted_during_a_recovery_finishes_it(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str], phase: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    name = f"takeover-{phase.lower()}"
    jobs.create(training_job(name, 2))
    trap = PhaseTrap(gemini_operator, phase)
    try:
        lost, old_uid, _, before = _lose_rank_one_node(local_cluster, jobs, job_namespace, name)
        assert trap.reached.wait(180), f"the recovery never reached {phase}"
        recovery = jobs.get(name)["status"]["recovery"]
        assert recovery["phase"] == phase, recovery
    finally:
        trap.release()
    gemini_operator.restart()  # a fresh operator continues from status.recovery
    last = _assert_recovered_from_peers(jobs, job_namespace, name, local_cluster.state_dir,
                                        lost, old_uid, reference, before)
    assert last["epoch"] >= recovery["epoch"]
    jobs.delete(name)


@pytest.mark.proves("group-loss-s3")
def test_losing_every_holder_of_a_shard_restores_the_committed_s3_step(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str], s3_server: Any, s3_prefix: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    endpoint = s3_server.endpoint
    create_credentials_secret(jobs.core, job_namespace, endpoint)
    job = training_job("durable", 2)
    job["spec"]["template"]["command"] = ["python", str(EXAMPLE), *ARGS[:-1], "1.0"]
    job["spec"]["persistence"] = persistence_spec(endpoint, s3_prefix, 30)
    jobs.create(job)
    persisted = wait_for(
        lambda: (jobs.get("durable") or {}).get("status", {}).get("checkpoint", {}).get(
            "persistedStep"), 300, "a step persisted to S3")
    pods = {p.metadata.name: p for p in jobs.pods("durable")}
    before = jobs.get("durable")["status"]
    local_cluster.add_spare()
    local_cluster.add_spare()
    for pod in pods.values():  # both ranks hold both shards: every copy is gone
        faults.lose_node(local_cluster.state_dir, pod.spec.node_name)
    last = wait_for(lambda: _recovered_after(jobs, "durable", before), 300,
                    "the recovery to finish")
    print(f"S3 recovery: persisted {persisted}, {last}")
    assert last["source"] == "S3" and last["restoredStep"] >= persisted, last
    assert {p.metadata.uid for p in jobs.pods("durable")}.isdisjoint(
        p.metadata.uid for p in pods.values())
    wait_for(lambda: jobs.state("durable") in ("Succeeded", "Failed"), 300, "the job to finish")
    assert jobs.get("durable")["status"]["state"] == "Succeeded"
    got, conflicts = losses(local_cluster.state_dir, job_namespace, "durable-worker-0")
    assert not conflicts
    assert got == reference
    jobs.delete("durable")


@pytest.mark.proves("suspend-resume")
def test_suspend_saves_the_newest_step_to_s3_and_resume_restores_it(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str], s3_server: Any, s3_prefix: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    endpoint = s3_server.endpoint
    create_credentials_secret(jobs.core, job_namespace, endpoint)
    job = training_job("pause", 2)
    job["spec"]["template"]["command"] = ["python", str(EXAMPLE), *ARGS[:-1], "2.0"]
    # One periodic upload (the first step) and then none: whatever is newer at the suspend
    # is only in memory, and only the save before suspending can keep it.
    job["spec"]["persistence"] = persistence_spec(endpoint, s3_prefix, 3600)
    jobs.create(job)
    state = local_cluster.state_dir
    wait_for(lambda: (jobs.get("pause") or {}).get("status", {}).get("checkpoint", {}).get(
        "persistedStep"), 300, "the first step persisted to S3")
    first = jobs.get("pause")["status"]["checkpoint"]["persistedStep"]
    wait_for(lambda: (jobs.get("pause") or {}).get("status", {}).get("checkpoint", {}).get(
        "inMemoryStep", 0) >= first + 2, 240, "two newer steps complete in memory")
    in_memory = jobs.get("pause")["status"]["checkpoint"]["inMemoryStep"]
    jobs.patch("pause", {"suspend": True})
    wait_for(lambda: jobs.state("pause") == "Suspended" and not jobs.pods("pause"), 240,
             "the pods to be gone")
    status = jobs.get("pause")["status"]
    saved = status["checkpoint"]["persistedStep"]
    assert saved >= in_memory > first, status["checkpoint"]
    assert newest_step(state, job_namespace, "pause-worker-0") < STEPS  # stopped mid-way
    reasons = {e.reason for e in jobs.events("pause")}
    assert "SuspendCheckpointSaved" in reasons, reasons
    jobs.patch("pause", {"suspend": False})
    last = wait_for(lambda: ((jobs.get("pause") or {}).get("status") or {}).get(
        "lastRecovery"), 300, "the resume to restore")
    print(f"resume: saved at suspend {saved}, {last}")
    assert last["cause"] == "resume" and last["source"] == "S3", last
    assert last["restoredStep"] >= saved
    wait_for(lambda: jobs.state("pause") in ("Succeeded", "Failed"), 300, "the job to finish")
    assert jobs.get("pause")["status"]["state"] == "Succeeded"
    # The suspended pods' logs went with them: the resumed pods print every step after the
    # restored one, each with the loss of an uninterrupted run.
    got, conflicts = losses(state, job_namespace, "pause-worker-0")
    assert not conflicts
    assert set(range(last["restoredStep"] + 1, STEPS + 1)) <= set(got), sorted(got)
    assert got == {step: reference[step] for step in got}
    assert "ResumedFromCheckpoint" in {e.reason for e in jobs.events("pause")}
    jobs.delete("pause")


SLOW_POLL_SECONDS = 30.0


@pytest.mark.proves("trainer-crash")
def test_a_crashed_training_process_is_acted_on_at_once_not_at_the_next_poll(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher of a crashed training process tells the operator (gemini_operator.calls.hints):
    with polls 30 s apart the recovery still starts within seconds of the crash."""
    from gemini_demo.crash import kill_training_process
    from gemini_operator.runtime import handlers

    jobs = Jobs(kube_api, job_namespace)
    jobs.create(training_job("hinted", 2))
    state = local_cluster.state_dir
    wait_for(lambda: newest_step(state, job_namespace, "hinted-worker-0") >= 3, 240,
             "training to reach step 3")
    monkeypatch.setattr(handlers, "POLL_SECONDS", SLOW_POLL_SECONDS)
    time.sleep(2.5)  # the round under way at 2 s ends; the next is 30 s away
    metric = gemini_operator.runtime.metrics.registry.get_sample_value
    hinted = metric("gemini_operator_failure_hints_total", {"result": "polled"}) or 0.0
    before = jobs.get("hinted")["status"]
    kill_training_process(state, job_namespace, "hinted-worker-1")
    killed_at = time.monotonic()
    wait_for(lambda: (jobs.get("hinted") or {}).get("status", {}).get("recovery")
             or _recovered_after(jobs, "hinted", before), 20, "a recovery to start")
    started = time.monotonic() - killed_at
    print(f"recovery started {started:.2f} s after the crash")
    assert (metric("gemini_operator_failure_hints_total", {"result": "polled"}) or 0) > hinted
    assert started < 5.0, f"the recovery started {started:.1f} s after the crash"
    last = wait_for(lambda: _recovered_after(jobs, "hinted", before), 120,
                    "the recovery to finish")
    assert last["source"] == "Local" and last["cause"] == "software", last
    jobs.delete("hinted")
