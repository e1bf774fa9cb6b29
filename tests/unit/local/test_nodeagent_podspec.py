"""Pure pod-spec rules of the node agent: quantities, $(VAR), downward API, env, phase."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from gemini_local.nodeagent.podspec import (
    ConfigError,
    PodFacts,
    container_env,
    expand,
    field_value,
    parse_quantity,
    pod_phase,
    referenced_objects,
    resource_value,
    restart_delay,
    should_restart,
)

POD = {"metadata": {"name": "w-0", "namespace": "train", "uid": "u-1",
                    "labels": {"rank": "3", "app": "x"}, "annotations": {"a/b": "c"}},
       "spec": {"nodeName": "node-1", "serviceAccountName": "sa"}}
FACTS = PodFacts(POD, "127.100.2.5", "127.100.2.1", {"cpu": "8", "memory": "32Gi"})


@pytest.mark.parametrize(("text", "value"), [
    ("500m", Fraction(1, 2)), ("2", 2), ("32Gi", 32 * 2**30), ("1k", 1000), ("1e3", 1000),
    ("1.5", Fraction(3, 2)), ("100Mi", 100 * 2**20), ("5e-1", Fraction(1, 2)),
    ("24682768Ki", 24682768 * 2**10),  # a real kubelet's memory capacity
])
def test_quantities_parse_exactly(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["lots", "1K", "1ki", "2mi"])
def test_a_malformed_quantity_is_a_config_error(text):
    with pytest.raises(ConfigError, match="not a quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(("text", "expanded"), [
    ("$(A)-$(B)", "1-2"), ("$$(A)", "$(A)"), ("$(MISSING)", "$(MISSING)"), ("$$$$", "$$"),
    ("no refs", "no refs"), ("$(A", "$(A"),
])
def test_variable_references_expand_like_the_kubelet(text, expanded):
    assert expand(text, {"A": "1", "B": "2"}) == expanded


@pytest.mark.parametrize(("path", "value"), [
    ("metadata.name", "w-0"), ("metadata.namespace", "train"), ("metadata.uid", "u-1"),
    ("spec.nodeName", "node-1"), ("status.podIP", "127.100.2.5"),
    ("status.hostIP", "127.100.2.1"), ("metadata.labels['rank']", "3"),
    ("metadata.annotations['a/b']", "c"), ("metadata.labels", 'app="x"\nrank="3"'),
    ("spec.serviceAccountName", "sa"),
])
def test_downward_api_fields(path, value):
    assert field_value(path, FACTS) == value


def test_unknown_field_path_is_refused():
    with pytest.raises(ConfigError, match="unsupported downward API"):
        field_value("status.phase", FACTS)


def test_resource_limits_fall_back_to_node_allocatable_and_round_up():
    container = {"resources": {"limits": {"memory": "1Gi"}, "requests": {"cpu": "250m"}}}
    assert resource_value({"resource": "limits.cpu"}, container, FACTS) == "8"
    assert resource_value({"resource": "limits.memory", "divisor": "1Mi"}, container,
                          FACTS) == "1024"
    assert resource_value({"resource": "requests.cpu"}, container, FACTS) == "1"
    assert resource_value({"resource": "requests.cpu", "divisor": "1m"}, container,
                          FACTS) == "250"


def test_env_order_envfrom_then_env_with_references():
    objects = {("configmap", "cfg"): {"data": {"A": "from-cm", "B": "b"}},
               ("secret", "sec"): {"data": {"tok": "czNjcjN0"}}}  # base64 of s3cr3t
    container = {
        "envFrom": [{"configMapRef": {"name": "cfg"}}, {"secretRef": {"name": "sec"},
                                                       "prefix": "S_"}],
        "env": [{"name": "A", "value": "override-$(B)"},
                {"name": "T", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "tok"}}},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "OPT", "valueFrom": {"configMapKeyRef": {
                    "name": "gone", "key": "k", "optional": True}}}],
    }
    env = container_env(container, FACTS, objects, {"PATH": "/venv/bin"})
    assert env == {"PATH": "/venv/bin", "A": "override-b", "B": "b", "S_tok": "s3cr3t",
                   "T": "s3cr3t", "IP": "127.100.2.5"}


def test_missing_required_config_map_is_a_config_error():
    container = {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope",
                                                                         "key": "k"}}}]}
    with pytest.raises(ConfigError, match="configmap 'nope' not found"):
        container_env(container, FACTS, {("configmap", "nope"): None}, {})


def test_referenced_objects_cover_env_envfrom_and_volumes():
    pod = {"spec": {
        "initContainers": [{"envFrom": [{"secretRef": {"name": "s1"}}]}],
        "containers": [{"env": [{"name": "a", "valueFrom": {"configMapKeyRef": {
            "name": "c1", "key": "k"}}}]}],
        "volumes": [{"name": "v", "secret": {"secretName": "s2"}},
                    {"name": "p", "projected": {"sources": [{"configMap": {"name": "c2"}}]}}]}}
    assert referenced_objects(pod) == {("secret", "s1"), ("configmap", "c1"),
                                       ("secret", "s2"), ("configmap", "c2")}


def test_restart_back_off_is_immediate_then_doubles_to_ten_seconds():
    assert [restart_delay(n) for n in range(1, 8)] == [0, 1, 2, 4, 8, 10, 10]


@pytest.mark.parametrize(("policy", "code", "restart"), [
    ("Always", 0, True), ("Always", 1, True), ("OnFailure", 0, False), ("OnFailure", 2, True),
    ("Never", 0, False), ("Never", 1, False),
])
def test_restart_policy(policy, code, restart):
    assert should_restart(policy, code) is restart


RUNNING: dict[str, Any] = {"running": {}}
WAITING: dict[str, Any] = {"waiting": {"reason": "PodInitializing"}}


def done(code):
    return {"terminated": {"exitCode": code}}


@pytest.mark.parametrize(("case", "args", "phase"), [
    ("init containers still running", ("Always", False, False, [WAITING], [False]), "Pending"),
    ("an init container failed for good", ("Never", False, True, [WAITING], [False]), "Failed"),
    ("containers not started yet", ("Never", True, False, [WAITING], [False]), "Pending"),
    ("one running", ("Never", True, False, [RUNNING, done(0)], [False, False]), "Running"),
    ("all succeeded", ("Never", True, False, [done(0), done(0)], [False, False]), "Succeeded"),
    ("one failed, no restart", ("Never", True, False, [done(0), done(1)], [False, False]),
     "Failed"),
    ("failed but restarting", ("OnFailure", True, False, [done(1)], [True]), "Running"),
    ("in back-off", ("Always", True, False, [{"waiting": {"reason": "CrashLoopBackOff"}}],
                     [True]), "Running"),
])
def test_pod_phase(case, args, phase):
    assert pod_phase(*args) == phase, case
