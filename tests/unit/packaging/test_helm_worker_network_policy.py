"""The chart tells the operator how each job's NetworkPolicy finds the operator: exactly this
release's pods in the release namespace, so the policy admits the operator and no look-alike."""

from __future__ import annotations

from typing import Any

from gemini_cli import build_parser
from tests.fixtures.helm import Helm, one


def _operator(objects: list[dict[str, Any]]) -> tuple[Any, dict[str, str]]:
    """The operator's parsed command line and its pods' labels."""
    template = one(objects, "Deployment")["spec"]["template"]
    container = template["spec"]["containers"][0]
    argv = [*container["command"], *container["args"]][1:]
    return build_parser().parse_args(argv), template["metadata"]["labels"]


def test_the_policy_admits_this_releases_operator_pods_from_its_namespace(helm: Helm):
    args, pod_labels = _operator(helm.template(release="g", namespace="ml-ops"))
    assert args.worker_network_policy is True
    assert args.operator_pod_labels.items() <= pod_labels.items()
    assert args.operator_pod_labels["app.kubernetes.io/instance"] == "g"
    assert args.operator_namespace_labels == {"kubernetes.io/metadata.name": "ml-ops"}
    assert args.worker_metrics_from == ()


def test_metrics_scrapers_and_opting_out_reach_the_operator(helm: Helm):
    scraper = "workerNetworkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=mon"
    args, _ = _operator(helm.template("--set", scraper))
    assert args.worker_metrics_from == ({"namespaceSelector": {"matchLabels": {"team": "mon"}}},)
    args, _ = _operator(helm.template("--set", "workerNetworkPolicy.enabled=false"))
    assert args.worker_network_policy is False


def test_the_operator_run_by_hand_admits_operator_pods_of_its_own_namespace_only() -> None:
    """Issue 45, item 6: any tenant can label a pod like the operator's; by default only the
    operator's own namespace (the lease's) is admitted, not every namespace."""
    from gemini_cli import build_parser
    from gemini_cli.operator import operator_namespace_labels

    args = build_parser().parse_args(["operator", "run", "--lease-namespace", "ml-ops"])
    assert args.operator_namespace_labels is None
    assert operator_namespace_labels(args.operator_namespace_labels, "ml-ops") == {
        "kubernetes.io/metadata.name": "ml-ops"}
    args = build_parser().parse_args(["operator", "run", "--operator-namespace-labels", ""])
    assert operator_namespace_labels(args.operator_namespace_labels, "x") == {}  # asked for
