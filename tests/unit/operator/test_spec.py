"""Spec parsing: defaults, typed values, and what the operator refuses beyond the schema."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from gemini_operator.core.quantity import QuantityError, parse_bytes, parse_quantity
from gemini_operator.core.spec import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    PlacementStrategy,
    RuleAction,
    SpecError,
    TrafficScheduling,
    parse_spec,
    validate_job_name,
)
from tests.unit.operator.builders import make_job

IMAGE = "gemini:test"


@pytest.mark.parametrize(("text", "value"), [
    ("1Ki", Decimal(1024)), ("2Gi", Decimal(2 << 30)), ("500m", Decimal("0.5")),
    ("1e3", Decimal(1000)), ("1.5G", Decimal(1_500_000_000)), (7, Decimal(7)), ("+3", Decimal(3)),
])
def test_quantities_parse_exactly(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["lots", "1Gb", "", "1.2.3", "--1"])
def test_non_quantities_are_refused(text):
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize("text", ["-1Gi", "1.5", "500m"])
def test_byte_counts_are_whole_and_non_negative(text):
    with pytest.raises(QuantityError):
        parse_bytes(text)


def test_minimal_spec_gets_the_schema_defaults():
    spec = parse_spec(make_job().spec(), IMAGE)
    assert spec.num_nodes == 4 and spec.num_proc_per_node == 1 and not spec.suspend
    assert spec.checkpoint.replicas == 2
    assert spec.checkpoint.placement is PlacementStrategy.DOMAIN_AWARE
    assert spec.checkpoint.traffic_scheduling is TrafficScheduling.INTERLEAVED
    assert spec.checkpoint.memory_budget_bytes == DEFAULT_MEMORY_BUDGET_BYTES
    assert not spec.checkpoint.peer_encryption
    assert spec.checkpoint.sidecar.image == IMAGE
    assert spec.failure_policy.max_restarts == 10
    assert spec.persistence is None


def test_full_spec_is_typed():
    raw = (
        make_job().with_nodes(8).with_replicas(3)
        .set("numProcPerNode", 2)
        .set("template.env", [{"name": "A", "value": "1"}, {
            "name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
        .set("checkpoint.placement", "Mixed")
        .set("checkpoint.memoryBudgetPerNode", "1Gi")
        .set("checkpoint.peerEncryption", True)
        .set("checkpoint.sidecar", {"image": "side:1", "resources": {"limits": {"memory": "2Gi"}}})
        .set("persistence", {"bucketURI": "s3://ckpt/run/1/",
                             "credentialsSecretRef": {"name": "s3"}})
        .set("failurePolicy.rules", [{"name": "oom", "action": "FailJob",
                                      "onPodFailureReasons": ["OOMKilled"], "onExitCodes": [137]}])
        .spec()
    )
    spec = parse_spec(raw, None)
    assert spec.world_size == 16
    assert spec.template.env[1].to_manifest()["valueFrom"]["secretKeyRef"]["key"] == "k"
    assert spec.checkpoint.placement is PlacementStrategy.MIXED
    assert spec.checkpoint.memory_budget_bytes == 1 << 30
    assert spec.checkpoint.peer_encryption
    assert spec.checkpoint.sidecar.resources.limits == {"memory": "2Gi"}
    assert spec.persistence is not None
    assert (spec.persistence.bucket, spec.persistence.prefix) == ("ckpt", "run/1")
    assert spec.persistence.credentials_secret == "s3"
    rule = spec.failure_policy.rules[0]
    assert rule.action is RuleAction.FAIL_JOB
    assert rule.on_exit_codes == frozenset({137}) and rule.on_pod_failure_reasons == {"OOMKilled"}


def test_memory_budget_defaults_to_the_sidecar_memory_limit():
    raw = make_job().set("checkpoint.sidecar", {"resources": {"limits": {"memory": "3Gi"}}}).spec()
    assert parse_spec(raw, IMAGE).checkpoint.memory_budget_bytes == 3 << 30


REFUSED = [
    pytest.param(make_job().set("checkpoint.memoryBudgetPerNode", "-1Gi"),
                 "spec.checkpoint.memoryBudgetPerNode", id="a negative memory budget"),
    pytest.param(make_job().set("checkpoint.memoryBudgetPerNode", "0"),
                 "more than 0 bytes", id="a zero memory budget"),
    pytest.param(make_job().set("checkpoint.memoryBudgetPerNode", "1.5"),
                 "whole, non-negative number of bytes", id="a fractional byte budget"),
    pytest.param(make_job().set("checkpoint.memoryBudgetPerNode", "4Gi")
                 .set("checkpoint.sidecar", {"resources": {"limits": {"memory": "1Gi"}}}),
                 "must fit within the sidecar's memory limit",
                 id="a budget larger than the sidecar's memory limit"),
    pytest.param(make_job().set("template.resourcesPerNode", {"requests": {"cpu": "-2"}}),
                 "cannot be negative", id="a negative resource request"),
    pytest.param(make_job().with_nodes(2).with_replicas(3), "at most spec.numNodes",
                 id="more replicas than nodes"),
    pytest.param(make_job().with_nodes(8192).set("numProcPerNode", 64), "ranks are supported",
                 id="more ranks than supported"),
    pytest.param(make_job().set("failurePolicy.rules", [{"name": "x", "action": "FailJob"}]),
                 "needs onExitCodes or onPodFailureReasons", id="a rule that matches nothing"),
    pytest.param(make_job().set("persistence", {"bucketURI": "gs://x/y"}), "s3://",
                 id="a non-S3 bucket"),
    pytest.param(make_job().set("persistence",
                                {"bucketURI": "s3://ckpt/run", "intervalSeconds": 0}),
                 "spec.persistence.intervalSeconds", id="uploads without a pause between"),
    pytest.param(make_job().drop("template"), "spec.template: is required", id="no template"),
    pytest.param(make_job().set("checkpoint.peerEncryption", "yes"),
                 "spec.checkpoint.peerEncryption: must be true or false", id="encryption as text"),
]


@pytest.mark.parametrize(("builder", "fragment"), REFUSED)
def test_operator_refuses_what_the_schema_cannot_express(builder, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec(builder.spec(), IMAGE)
    assert fragment in str(info.value)


def test_without_any_sidecar_image_the_spec_is_refused_with_the_fix():
    with pytest.raises(SpecError) as info:
        parse_spec(make_job().spec(), None)
    assert info.value.field_path == "spec.checkpoint.sidecar.image"
    assert "--sidecar-image" in info.value.message


@pytest.mark.parametrize(("name", "ok"), [
    ("train", True), ("a" * 48, True), ("a" * 49, False), ("1abc", False), ("Abc", False),
    ("abc-", False),
])
def test_job_names_must_leave_room_for_children(name, ok):
    if ok:
        validate_job_name(name)
    else:
        with pytest.raises(SpecError):
            validate_job_name(name)


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[3] / "examples").glob("geminijob-*.yaml")),
    ids=lambda p: p.name,
)
def test_every_example_parses(path):
    for body in yaml.safe_load_all(path.read_text()):
        validate_job_name(body["metadata"]["name"])
        assert parse_spec(body["spec"], IMAGE).num_nodes >= 1


def test_warm_standby_defaults_on_and_must_be_a_boolean():
    assert parse_spec(make_job().spec(), "img").failure_policy.warm_standby is True
    assert parse_spec(make_job().set("failurePolicy.warmStandby", False).spec(),
                      "img").failure_policy.warm_standby is False
    with pytest.raises(SpecError) as info:
        parse_spec(make_job().set("failurePolicy.warmStandby", "yes").spec(), "img")
    assert str(info.value) == "spec.failurePolicy.warmStandby: must be true or false, got 'yes'"


def test_in_process_restart_defaults_on_and_must_be_a_boolean():
    assert parse_spec(make_job().spec(), "img").failure_policy.in_process_restart is True
    off = make_job().set("failurePolicy.inProcessRestart", False).spec()
    assert parse_spec(off, "img").failure_policy.in_process_restart is False
    with pytest.raises(SpecError) as info:
        parse_spec(make_job().set("failurePolicy.inProcessRestart", 1).spec(), "img")
    assert "spec.failurePolicy.inProcessRestart: must be true or false" in str(info.value)
