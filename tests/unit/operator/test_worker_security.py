"""Worker pods are hardened by default (Pod Security `restricted`), probed, and fenced by a
per-job NetworkPolicy; a template may ask for its own user, root (`baseline`) or a token."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gemini_operator.core import children, naming, render, spares
from gemini_operator.core.actions import CreateNetworkPolicy
from gemini_operator.core.decide import decide
from gemini_operator.core.spec import SpecError, parse_spec
from gemini_operator.core.types import JobView, Observed, ReconcileConfig
from tests.unit.operator.builders import make_job

JOB = render.JobRef("train", "ml", "uid-1")
CONFIG = render.RenderConfig()
HARDENED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _spec(builder=None):
    return parse_spec((builder or make_job()).spec(), "gemini:side")


def _pod(builder=None):
    return render.worker_pod(JOB, _spec(builder), 1, 0, CONFIG)


def _containers(pod):
    return {c["name"]: c for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]}


# --- securityContext ------------------------------------------------------------------------

def test_a_default_worker_pod_meets_the_restricted_pod_security_standard():
    pod = _pod()
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True,
                                              "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["automountServiceAccountToken"] is False
    for name, container in _containers(pod).items():
        assert container["securityContext"] == HARDENED, name


def test_spare_placeholders_are_hardened_like_the_workers():
    pod = spares.spare_pod(JOB, _spec(), 0, CONFIG)
    assert pod["spec"]["securityContext"] == _pod()["spec"]["securityContext"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    for container in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]:
        assert container["securityContext"] == HARDENED, container["name"]


def test_a_named_user_and_group_apply_to_the_whole_pod():
    pod = _pod(make_job().set("template.securityContext", {"runAsUser": 1000,
                                                           "runAsGroup": 2000}))
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 2000,
        "seccompProfile": {"type": "RuntimeDefault"}}
    for container in _containers(pod).values():
        assert container["securityContext"] == HARDENED


def test_user_0_makes_only_the_trainer_root_with_default_capabilities():
    pod = _pod(make_job().set("template.securityContext", {"runAsUser": 0}))
    containers = _containers(pod)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True  # the sidecar stays non-root
    assert "runAsUser" not in pod["spec"]["securityContext"]
    assert containers[naming.TRAINER_CONTAINER]["securityContext"] == {
        "runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False}
    assert containers[naming.SIDECAR_CONTAINER]["securityContext"] == HARDENED


def test_the_template_may_ask_for_the_service_account_token():
    pod = _pod(make_job().set("template.automountServiceAccountToken", True))
    assert pod["spec"]["automountServiceAccountToken"] is True


@pytest.mark.parametrize(("field", "value", "says"), [
    ("template.securityContext", {"runAsUser": -1}, "runAsUser: is -1 but must be at least 0"),
    ("template.securityContext", {"runAsGroup": "root"}, "runAsGroup: must be a whole number"),
    ("template.securityContext", {"runAsUser": 1 << 31}, "must be at most 2147483647"),
    ("template.automountServiceAccountToken", "yes", "must be true or false"),
])
def test_bad_security_fields_are_refused(field, value, says):
    with pytest.raises(SpecError, match=says):
        _spec(make_job().set(field, value))


# --- probes ---------------------------------------------------------------------------------

def test_the_sidecar_is_probed_on_its_healthz():
    sidecar = _containers(_pod())[naming.SIDECAR_CONTAINER]
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    expected = {"startupProbe": (1, 1, 30), "livenessProbe": (10, 3, 3),
                "readinessProbe": (5, 2, 2)}
    for kind, (period, timeout, failures) in expected.items():
        probe = sidecar[kind]
        assert probe["httpGet"] == {"path": "/healthz", "port": "sidecar-probe"}, kind
        assert ports[probe["httpGet"]["port"]] == CONFIG.sidecar_probe_port
        assert (probe["periodSeconds"], probe["timeoutSeconds"],
                probe["failureThreshold"]) == (period, timeout, failures), kind
    trainer = _containers(_pod())[naming.TRAINER_CONTAINER]
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(trainer)


# --- the NetworkPolicy ----------------------------------------------------------------------

def test_the_network_policy_admits_the_job_and_the_operator_only():
    policy = children.network_policy(JOB, CONFIG)
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["name"] == "train-workers"
    assert policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["ownerReferences"] == [render.owner_reference(JOB)]
    workers = {"matchLabels": {naming.LABEL_JOB: "train", naming.LABEL_ROLE: "worker"}}
    assert policy["spec"]["podSelector"] == workers
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (S3, DNS) stays open
    own, operator = policy["spec"]["ingress"]
    # The job's own workers on every port: collectives open ports of their own.
    assert own == {"from": [{"podSelector": workers}]}
    assert operator == {
        "from": [{"namespaceSelector": {"matchLabels": {}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gemini-operator"}}}],
        "ports": [{"protocol": "TCP", "port": 7071}, {"protocol": "TCP", "port": 7080}],
    }


def test_the_operator_selector_and_metrics_scrapers_are_configurable():
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    config = render.RenderConfig(
        operator_pod_labels={"app.kubernetes.io/instance": "g"},
        operator_namespace_labels={"kubernetes.io/metadata.name": "gemini-system"},
        metrics_from=(prometheus,))
    _, operator, metrics = children.network_policy(JOB, config)["spec"]["ingress"]
    assert operator["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gemini-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "g"}}}]
    assert metrics == {"from": [prometheus], "ports": [{"protocol": "TCP", "port": 7071}]}


def _observed(has_policy: bool) -> Observed:
    job = make_job("train").with_uid("uid-1").obj()
    return Observed(job=JobView.from_object(job), pods={}, nodes={}, has_service=True,
                    has_secret=True, now=datetime(2026, 1, 1, tzinfo=UTC),
                    has_network_policy=has_policy)


def test_the_policy_is_created_with_the_other_children_until_it_exists():
    config = ReconcileConfig(default_sidecar_image="gemini:side")
    (created,) = [a for a in decide(_observed(False), config).actions
                  if isinstance(a, CreateNetworkPolicy)]
    assert created.manifest["metadata"]["name"] == naming.network_policy_name("train")
    assert not [a for a in decide(_observed(True), config).actions
                if isinstance(a, CreateNetworkPolicy)]


def test_no_policy_when_the_operator_is_told_not_to_make_one():
    config = ReconcileConfig(render=render.RenderConfig(network_policy=False),
                             default_sidecar_image="gemini:side")
    assert not [a for a in decide(_observed(False), config).actions
                if isinstance(a, CreateNetworkPolicy)]
