"""What cannot recover ends clearly, and fast, on the local cluster.

A training command that dies at once counts as a restart each time and fails the job after
spec.failurePolicy.maxRestarts, naming the exit code and the last lines of its log. A worker
that cannot start at all (a missing Secret, a pod the scheduler cannot place) shows in the
job's conditions within seconds, naming the pod and the cause. (An image that cannot be pulled
is not reproducible here: the node agents run host processes and pull no images; the decision
layer's unit tests cover it.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.test_operator import Jobs, wait_for
from tests.fixtures.operator import OperatorThread
from tests.unit.operator.builders import make_job

pytestmark = pytest.mark.cluster

# Sees the start of a condition that names the cause; the node agent reports a missing Secret
# within a second or so, the scheduler its verdict at once.
CANNOT_START_SECONDS = 20


def _running_condition(jobs: Jobs, name: str) -> Any:
    found = jobs.condition(name, "Running")
    return found if found and found["reason"] == "WorkersCannotStart" else None


def _cannot_start(jobs: Jobs, name: str) -> Any:
    """The WorkersCannotStart condition, once it shows; what there is on a timeout."""
    try:
        return wait_for(lambda: _running_condition(jobs, name), CANNOT_START_SECONDS,
                        "WorkersCannotStart")
    except AssertionError:
        statuses = [(p.metadata.name, p.status.to_dict()) for p in jobs.pods(name)]
        raise AssertionError(f"no WorkersCannotStart: {jobs.get(name)}; pods {statuses}"
                             ) from None


def test_a_command_that_dies_at_start_fails_the_job_after_max_restarts(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    script = "import sys; print('loading the model'); sys.exit('ImportError: no module torch')"
    jobs.create(make_job("dies").with_nodes(2)
                .set("template.command", ["python", "-c", script])
                .set("failurePolicy.maxRestarts", 2).obj())
    started = time.monotonic()
    wait_for(lambda: jobs.state("dies") == "Failed", 180, "the job to fail")
    print(f"failed after {time.monotonic() - started:.1f} s")
    job = jobs.get("dies")
    assert job["status"]["restarts"] == 2, job["status"]
    failed = jobs.condition("dies", "Failed")
    assert failed["reason"] == "MaxRestartsExceeded", failed
    assert "exited with code 1" in failed["message"], failed
    assert "ImportError: no module torch" in failed["message"], failed
    # Events follow the last status write.
    wait_for(lambda: "MaxRestartsExceeded" in [e.reason for e in jobs.events("dies")], 10,
             "the MaxRestartsExceeded event")
    assert not [p for p in jobs.pods("dies")
                if p.status.phase not in ("Succeeded", "Failed")
                and p.metadata.deletion_timestamp is None], "pods still run"
    jobs.delete("dies")


def test_false_as_the_command_fails_the_job_after_max_restarts(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    """The case as a new user met it: it exits at once, before the launcher has answered."""
    jobs = Jobs(kube_api, job_namespace)
    jobs.create(make_job("false").with_nodes(2).set("template.command", ["false"])
                .set("failurePolicy.maxRestarts", 2).obj())
    wait_for(lambda: jobs.state("false") == "Failed", 180, "the job to fail")
    job = jobs.get("false")
    assert job["status"]["restarts"] == 2, job["status"]
    failed = jobs.condition("false", "Failed")
    assert failed["reason"] == "MaxRestartsExceeded" and "code 1" in failed["message"], failed
    jobs.delete("false")


def test_a_missing_secret_shows_in_the_conditions_within_seconds(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    env = [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]
    jobs.create(make_job("nosecret").with_nodes(2).set("template.env", env).obj())
    wait_for(lambda: jobs.pods("nosecret"), 30, "the worker pods")
    created = time.monotonic()
    found = _cannot_start(jobs, "nosecret")
    print(f"shown after {time.monotonic() - created:.1f} s: {found['message']}")
    assert found["status"] == "False"
    assert "nosecret-worker-" in found["message"] and "CreateContainerConfigError" in found[
        "message"], found
    assert "absent" in found["message"], found
    wait_for(lambda: "WorkersCannotStart" in [e.reason for e in jobs.events("nosecret")], 10,
             "the WorkersCannotStart event")
    jobs.delete("nosecret")


def test_a_pod_that_cannot_be_scheduled_shows_in_the_conditions_within_seconds(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    jobs.create(make_job("noroom").with_nodes(2)
                .set("template.resourcesPerNode", {"requests": {"cpu": "100000"}}).obj())
    wait_for(lambda: jobs.pods("noroom"), 30, "the worker pods")
    created = time.monotonic()
    found = _cannot_start(jobs, "noroom")
    print(f"shown after {time.monotonic() - created:.1f} s: {found['message']}")
    assert "noroom-worker-" in found["message"] and "cannot be scheduled" in found["message"]
    jobs.delete("noroom")
