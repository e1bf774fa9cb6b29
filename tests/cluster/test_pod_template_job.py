"""A v1beta1 GeminiJob whose pod template asks for what a GPU cluster needs: nodes picked by
a nodeSelector and tainted (tolerated), a dataset volume, a service account and a priority
class. It runs, loses a node, and its replacement lands on the one node left that the template
allows; the trainer reads its dataset in every pod, restores the step the operator chose, and
the losses equal an uninterrupted run's."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import (
    ARGS,
    ENV,
    _assert_recovered_from_peers,
    _lose_rank_one_node,
    log_texts,
)
from tests.fixtures.operator import OperatorThread
from tests.fixtures.trainers import EXAMPLE, SharedReferences
from tests.unit.operator.builders import make_job

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]
POOL = "gemini.test/pool"
MARKER = "tokens-v3"


@pytest.fixture(scope="module")
def reference(shared_references: SharedReferences) -> dict[int, str]:
    return shared_references(2, ARGS)


def pod_template(pool: str, priority: str) -> dict[str, Any]:
    # The trainer refuses to start without its dataset: the volume must reach every pod.
    script = (f'test "$(cat /data/marker)" = {MARKER} || exit 3; '
              f'exec python {EXAMPLE} {" ".join(ARGS)}')
    return {
        "metadata": {"labels": {"team": "llm"}, "annotations": {"owner": "tests"}},
        "spec": {
            "nodeSelector": {POOL: pool},
            "tolerations": [{"key": POOL, "operator": "Equal", "value": pool,
                             "effect": "NoSchedule"}],
            "serviceAccountName": "trainer",
            "priorityClassName": priority,
            "volumes": [{"name": "dataset", "configMap": {"name": "dataset"}}],
            "containers": [{
                "name": "trainer", "image": "gemini:local", "command": ["sh", "-c", script],
                "env": ENV, "volumeMounts": [{"name": "dataset", "mountPath": "/data",
                                              "readOnly": True}],
            }],
        },
    }


@pytest.mark.long  # node-agent twin of the kubelet cases' templated jobs
@pytest.mark.proves("node-loss")
def test_a_pod_template_job_runs_on_its_tainted_nodes_and_recovers_a_node_loss(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, reference: dict[int, str],
) -> None:
    core, scheduling = client.CoreV1Api(kube_api), client.SchedulingV1Api(kube_api)
    pool, priority = f"p-{uuid.uuid4().hex[:6]}", f"gemini-test-{uuid.uuid4().hex[:6]}"
    nodes = [local_cluster.add_spare(zone=f"zone-{i % 2}").name for i in range(3)]
    for name in nodes:  # only these may run the job, and only a job that tolerates them
        core.patch_node(name, {"metadata": {"labels": {POOL: pool}}, "spec": {"taints": [
            {"key": POOL, "value": pool, "effect": "NoSchedule"}]}})
    core.create_namespaced_service_account(job_namespace, {"metadata": {"name": "trainer"}})
    core.create_namespaced_config_map(job_namespace, {"metadata": {"name": "dataset"},
                                                      "data": {"marker": MARKER}})
    scheduling.create_priority_class({"metadata": {"name": priority}, "value": 1000})
    try:
        jobs = Jobs(kube_api, job_namespace)
        body = (make_job("pods").with_nodes(2).with_replicas(2)
                .set("template", pod_template(pool, priority))
                .set("failurePolicy.maxRestarts", 5).obj())
        jobs.create(body)
        wait_for(lambda: len([p for p in jobs.pods("pods") if p.spec.node_name]) == 2, 120,
                 "both workers to be scheduled")
        for pod in jobs.pods("pods"):
            assert pod.spec.node_name in nodes, pod.spec.node_name
            assert pod.spec.service_account_name == "trainer"
            assert pod.spec.priority_class_name == priority and pod.spec.priority == 1000
            assert pod.metadata.labels["team"] == "llm"
        lost, old_uid, _, before = _lose_rank_one_node(local_cluster, jobs, job_namespace,
                                                       "pods")
        last = _assert_recovered_from_peers(jobs, job_namespace, "pods",
                                            local_cluster.state_dir, lost, old_uid, reference,
                                            before)
        (replacement,) = [p for p in jobs.pods("pods") if p.metadata.name == "pods-worker-1"]
        assert replacement.spec.node_name in set(nodes) - {lost}
        # The replacement's own log: it started from the restored step, not from step 0.
        texts = log_texts(local_cluster.state_dir, job_namespace, "pods-worker-1")
        restored = int(last["restoredStep"])
        assert any(re.search(rf"restored step {restored}\b", t) for t in texts[-1:]), texts[-1:]
        first = min(int(m.group(1)) for m in re.finditer(r"^step (\d+) loss", texts[-1], re.M))
        assert first == restored + 1, (first, restored)
        jobs.delete("pods")
    finally:
        scheduling.delete_priority_class(priority)


@pytest.mark.proves("refused-pod-template", "misspelled-pod-field")
def test_a_template_whose_pods_the_api_server_refuses_fails_naming_the_field(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str,
) -> None:
    jobs = Jobs(kube_api, job_namespace)
    template = {"spec": {
        "tolerations": [{"key": "k", "operator": "Exists", "effect": "Sometimes"}],
        "containers": [{"name": "trainer", "image": "gemini:local", "command": ["true"]}]}}
    jobs.create(make_job("refused").with_nodes(2).set("template", template).obj())
    failed = wait_for(lambda: jobs.condition("refused", "Failed"), 60, "the job to fail")
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec", failed
    assert "spec.template.spec" in failed["message"], failed["message"]
    assert "spec.tolerations[0].effect" in failed["message"], failed["message"]
    # A misspelled field (issue 44): the pods are created with strict field validation, so
    # the API server refuses it by name instead of dropping it with a warning.
    misspelled = {"spec": {"nodeSelecter": {"pool": "training"}, "containers": [
        {"name": "trainer", "image": "gemini:local", "command": ["true"]}]}}
    jobs.create(make_job("misspelled").with_nodes(2).set("template", misspelled).obj())
    typo = wait_for(lambda: jobs.condition("misspelled", "Failed"), 60, "the job to fail")
    assert typo["status"] == "True" and typo["reason"] == "InvalidSpec", typo
    assert 'unknown field "spec.nodeSelecter"' in typo["message"], typo["message"]
    for name in ("refused", "misspelled"):
        wait_for(lambda n=name: not jobs.pods(n), 60, "no pod left")
        jobs.delete(name)
