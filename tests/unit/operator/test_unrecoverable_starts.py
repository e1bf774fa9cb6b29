"""What cannot recover ends clearly, and fast: a training command that dies at start counts as
a restart each time, also when it dies during a recovery's own restart, and fails the job
after maxRestarts with its exit code and last log lines; workers that cannot start at all
show in the Running condition, naming the pod and the cause."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gemini_operator.calls.worker_calls import launch_record
from gemini_operator.core import naming
from gemini_operator.core.actions import DeletePods, Recover
from gemini_operator.core.decide_failures import relaunch_exits
from gemini_operator.core.failures import log_note, log_tail
from gemini_operator.core.observed import ContainerExit, PodView, pod_view
from gemini_operator.core.records import RecoveryPhase, RecoveryRecord
from gemini_operator.core.render import JobRef, RenderConfig, worker_pod
from gemini_operator.core.spec import parse_spec
from tests.unit.operator.builders import make_job
from tests.unit.operator.test_decide import CONFIG, Harness, _of

TRACEBACK = ("Traceback (most recent call last):\n  File \"train.py\", line 1, in <module>\n"
             "    import torch\nModuleNotFoundError: No module named 'torch'\n")
PODS = {r: PodView(f"train-worker-{r}", r, 0, f"u{r}", "Running", node_name=f"n{r}",
                   ready=True, ip=f"10.0.0.{r}") for r in range(2)}


def _crashed(pod: PodView, restarts: int, message: str = TRACEBACK) -> PodView:
    return replace(pod, trainer_restarts=restarts,
                   trainer_last_exit=ContainerExit(1, "Error", message))


def test_during_a_recovery_one_more_restart_is_the_failed_epoch_and_a_second_is_the_new() -> None:
    launch = launch_record(1, 0, PODS, RenderConfig())
    once = {r: _crashed(p, 1) for r, p in PODS.items()}
    assert relaunch_exits(once, launch, 0) == {}  # the failed epoch ending on every rank
    twice = {**once, 1: _crashed(PODS[1], 2)}
    assert relaunch_exits(twice, launch, 0) == {1: 1}
    assert relaunch_exits(twice, launch, 1) == {}  # another attempt's launch record
    assert relaunch_exits(twice, None, 0) == {}  # training never started
    replacement = {**PODS, 1: _crashed(replace(PODS[1], uid="new"), 1)}
    assert relaunch_exits(replacement, launch, 0) == {1: 1}  # it never ran the failed epoch


def _dying_job() -> Harness:
    """Two workers running; training started; the command dies with a traceback."""
    h = Harness(make_job().with_nodes(2).set("failurePolicy.maxRestarts", 2))
    h.step()
    h.run_pods()
    h.deliver()
    h.step()
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    return h


def _recovering(h: Harness, epoch: int) -> None:
    """What the executor records once it restarts the launchers with `epoch`."""
    record = RecoveryRecord(epoch=epoch, phase=RecoveryPhase.RESTARTING, kind="software",
                            cause="rank 0: the training process exited with code 1")
    h.job["status"]["recovery"] = record.to_dict()


def test_a_command_that_dies_at_start_counts_each_restart_then_fails_with_its_log() -> None:
    h = _dying_job()
    h.pods = {r: _crashed(p, 1) for r, p in h.pods.items()}
    d = h.step()
    assert _of(d, Recover) and h.status()["restarts"] == 1
    _recovering(h, 2)

    # Each launcher held again; the recovery's restarts not taken yet: it goes on.
    d = h.step()
    assert _of(d, Recover) and h.status()["restarts"] == 1 and h.status()["recovery"]

    # The recovery's epoch dies at once as well: a restart counted, a new recovery begins.
    h.pods[0] = _crashed(h.pods[0], 2)
    d = h.step()
    (recover,) = _of(d, Recover)
    assert [f.rank for f in recover.failures] == [0]
    status = h.status()
    assert status["restarts"] == 2 and "recovery" not in status
    assert status["launch"]["epoch"] == 2  # the next recovery is epoch 3
    assert status["launch"]["trainerRestarts"] == {"0": 2, "1": 1}
    assert h.condition("Recovering")["status"] == "True"
    (again,) = [e for e in d.events if e.reason == "RecoveryNeeded"]
    assert "epoch 2 failed too" in again.message and again.warning

    # Epoch 3 dies too: no restart left; the job fails, naming the code and the log.
    _recovering(h, 3)
    h.pods[1] = _crashed(h.pods[1], 2)  # rank 1's end of epoch 2: allowed
    assert _of(h.step(), Recover) and h.status()["state"] == "Recovering"
    h.pods[1] = _crashed(h.pods[1], 3)
    d = h.step()
    assert h.status()["state"] == "Failed" and h.status()["restarts"] == 2
    failed = h.condition("Failed")
    assert failed["reason"] == "MaxRestartsExceeded"
    assert "rank 1: the training process exited with code 1" in failed["message"]
    assert "ModuleNotFoundError: No module named 'torch'" in failed["message"]
    assert _of(d, DeletePods) and not _of(d, Recover)
    assert "MaxRestartsExceeded" in {e.reason for e in d.events}
    assert h.status()["completionTime"]


def test_a_failure_outside_a_recovery_names_its_log_lines_when_the_job_fails() -> None:
    h = Harness(make_job().with_nodes(2).set("failurePolicy.maxRestarts", 0))
    h.step()
    h.run_pods()
    h.deliver()
    h.step()
    h.job["status"]["launch"] = launch_record(1, 0, h.pods, CONFIG.render).to_dict()
    h.pods[1] = _crashed(h.pods[1], 1)
    h.step()
    message = h.condition("Failed")["message"]
    assert message.startswith("rank 1: the training process exited with code 1; no recovery")
    assert message.endswith("the last lines of rank 1's log:\n" + TRACEBACK.strip())


def test_the_log_tail_keeps_the_last_lines_within_bounds() -> None:
    text = "\n".join(f"line {i}" for i in range(100)) + "\n\n"
    assert log_tail(text).splitlines() == [f"line {i}" for i in range(90, 100)]
    assert len(log_tail("x" * 5000)) == 1500
    assert log_tail("") == ""
    assert log_note([]) == ""


def test_the_pod_view_reads_the_termination_message() -> None:
    pod = {"metadata": {"name": "p", "labels": {naming.LABEL_RANK: "0"}},
           "status": {"phase": "Running", "containerStatuses": [{
               "name": naming.TRAINER_CONTAINER, "restartCount": 1,
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                            "message": TRACEBACK}},
               "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    view = pod_view(pod)
    assert view is not None and view.trainer_last_exit == ContainerExit(1, "Error", TRACEBACK)
    assert view.start_problem == ""  # a crash loop is counted as failures, not as this


def test_the_trainer_keeps_its_last_log_lines_when_it_fails() -> None:
    spec = parse_spec(make_job().obj()["spec"], "gemini:side")
    manifest = worker_pod(JobRef("train", "default", "u"), spec, 0, 0, RenderConfig())
    (trainer,) = [c for c in manifest["spec"]["containers"]
                  if c["name"] == naming.TRAINER_CONTAINER]
    assert trainer["terminationMessagePolicy"] == "FallbackToLogsOnError"


def _status(conditions: Sequence[object] = (), init: Sequence[object] = (),
            containers: Sequence[object] = ()) -> dict[str, Any]:
    return {"metadata": {"name": "train-worker-1", "labels": {naming.LABEL_RANK: "1"}},
            "status": {"phase": "Pending", "conditions": list(conditions),
                       "initContainerStatuses": list(init),
                       "containerStatuses": list(containers)}}


def _waiting(name: str, reason: str, message: str) -> dict[str, object]:
    return {"name": name, "state": {"waiting": {"reason": reason, "message": message}}}


def test_the_pod_view_names_why_a_pod_cannot_start() -> None:
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/4 nodes are available: 4 Insufficient cpu."}
    cases = {
        "cannot be scheduled: 0/4 nodes are available: 4 Insufficient cpu.":
            _status(conditions=[unschedulable]),
        "container sidecar cannot start: CreateContainerConfigError: secret \"s3\" not found":
            _status(init=[_waiting("sidecar", "CreateContainerConfigError",
                                   "secret \"s3\" not found")]),
        "container trainer cannot start: ErrImagePull: pull access denied for nope":
            _status(containers=[_waiting("trainer", "ErrImagePull",
                                         "pull access denied for nope")]),
        "container trainer cannot start: ImagePullBackOff: Back-off pulling image \"nope\"":
            _status(containers=[_waiting("trainer", "ImagePullBackOff",
                                         "Back-off pulling image \"nope\"")]),
        "": _status(containers=[_waiting("trainer", "ContainerCreating", "")]),
    }
    for expected, pod in cases.items():
        view = pod_view(pod)
        assert view is not None and view.start_problem == expected, pod


def test_workers_that_cannot_start_show_in_the_running_condition_within_a_reconcile() -> None:
    h = Harness()
    h.step()
    h.run_pods(phase="Pending", ready=False)
    problem = "container trainer cannot start: ErrImagePull: pull access denied for nope"
    h.pods[2] = replace(h.pods[2], start_problem=problem)
    h.pods[3] = replace(h.pods[3], start_problem=problem)
    d = h.step()
    running = h.condition("Running")
    assert (running["status"], running["reason"]) == ("False", "WorkersCannotStart")
    assert running["message"] == f"pod train-worker-2 {problem} (and 1 more pods)"
    (event,) = [e for e in d.events if e.reason == "WorkersCannotStart"]
    assert event.warning
    h.pods = {r: replace(p, start_problem="") for r, p in h.pods.items()}
    h.step()
    assert h.condition("Running")["reason"] == "WorkersStarting"


def test_a_replacement_that_cannot_start_shows_during_the_recovery() -> None:
    h = _dying_job()
    h.pods[1] = _crashed(h.pods[1], 1)
    h.step()
    _recovering(h, 2)
    h.pods[1] = replace(h.pods[1], uid="new", trainer_restarts=0, trainer_last_exit=None,
                        start_problem="cannot be scheduled: 0/4 nodes are available")
    d = h.step()
    assert _of(d, Recover) and h.status()["state"] == "Recovering"
    running = h.condition("Running")
    assert running["reason"] == "WorkersCannotStart" and "train-worker-1" in running["message"]
