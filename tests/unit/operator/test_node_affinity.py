"""Replacements and placeholders steered off lost nodes and towards spares, within the node
affinity the job's pod template gives them."""

from __future__ import annotations

import copy

from gemini_operator.core.node_affinity import avoiding_nodes, preferring_nodes

GPU_TERM = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
ZONE_TERM = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}],
             "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]}
USER_PREFERENCE = {"weight": 5, "preference": GPU_TERM}


def _templated() -> dict:
    return {"spec": {"affinity": {
        "podAntiAffinity": {"x": 1},
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [GPU_TERM, ZONE_TERM]},
            "preferredDuringSchedulingIgnoredDuringExecution": [USER_PREFERENCE]}}}}


def test_lost_nodes_are_avoided_with_one_value_per_requirement():
    pod = avoiding_nodes({"spec": {"affinity": {"podAntiAffinity": {}}}}, ["n1", "n3"])
    (term,) = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["n1"]},
        {"key": "metadata.name", "operator": "NotIn", "values": ["n3"]}]
    assert "podAntiAffinity" in pod["spec"]["affinity"]
    assert avoiding_nodes({"spec": {}}, []) == {"spec": {}}


def test_the_templates_required_terms_each_keep_their_rules_and_gain_the_avoidance():
    # Terms are ORed: the avoidance must join every one, or a pod could match a term without it.
    original = _templated()
    pod = avoiding_nodes(original, ["n1"])
    gpu, zone = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    off = {"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}
    assert gpu == {**GPU_TERM, "matchFields": [off]}
    assert zone["matchExpressions"] == ZONE_TERM["matchExpressions"]
    assert zone["matchFields"] == [*ZONE_TERM["matchFields"], off]
    assert original == _templated()  # the rendered manifest is not changed in place


def test_spare_preferences_follow_the_templates_own():
    pod = preferring_nodes(_templated(), ["s1", "s2"])
    preferred = pod["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0] == USER_PREFERENCE
    assert [p["preference"]["matchFields"][0]["values"] for p in preferred[1:]] == [["s1"],
                                                                                  ["s2"]]
    required = copy.deepcopy(_templated()["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"])
    assert pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"] == required
    assert preferring_nodes({"spec": {}}, []) == {"spec": {}}
