"""The Helm chart: lint, rendering with default and non-default values, least-privilege RBAC,
the monitoring objects refused without their API, the values schema, and the files the chart
copies staying identical to their sources. Uses the real helm binary (hack/build-helm.sh)."""

from __future__ import annotations

import base64
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gemini.metric_labels import TARGET_LABELS
from gemini_cli.operator import IDENTITY_ENV
from gemini_operator.core import naming, render
from gemini_operator.core.spec import parse_spec
from gemini_operator.runtime import health
from tests.fixtures.helm import CHART, Helm, RenderError, by_kind, one
from tests.unit.operator.builders import make_job
from tests.unit.packaging import dockerfile
from tests.unit.packaging.commands import unknown_part
from tests.unit.packaging.test_dashboard import selectors

ROOT = Path(__file__).resolve().parents[3]
MONITORING = "monitoring.coreos.com/v1"
STANDARD_LABELS = ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by")


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return found


# --- lint and defaults --------------------------------------------------------------------------

def test_helm_lint_strict_passes_with_default_and_minimal_values(helm: Helm):
    """(Monitors cannot be linted: `helm lint` has no --api-versions; rendering tests cover
    them.)"""
    for args in ([], ["--set", "crds.install=false,dashboards.enabled=false,rbac.create=false",
                      "--set", "serviceAccount.create=false,serviceAccount.name=operator",
                      "--set", "metrics.service.enabled=false,replicaCount=0",
                      "--kube-version", "1.29.0"]):
        result = helm.run(["lint", "--strict", str(CHART), *args])
        assert result.returncode == 0, result.stdout + result.stderr


def test_default_render_has_one_of_each_object_and_no_monitoring(helm: Helm):
    kinds = sorted(o["kind"] for o in helm.template())
    assert kinds == sorted([
        "ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
        "CustomResourceDefinition",
        "Deployment", "NetworkPolicy", "PriorityClass", "PriorityClass", "Role",
        "RoleBinding", "Secret", "Service", "Service", "ServiceAccount",
    ])


def test_every_object_carries_the_standard_labels(helm: Helm):
    for obj in helm.template():
        labels = obj["metadata"].get("labels", {})
        missing = [k for k in STANDARD_LABELS if k not in labels]
        assert not missing, f"{obj['kind']} {obj['metadata']['name']} lacks {missing}"


def test_names_fit_63_characters_with_the_longest_release_name(helm: Helm):
    objects = helm.template("--set", "podMonitor.enabled=true", "--api-versions",
                            f"{MONITORING}/PodMonitor", release="r" * 53)
    for obj in objects:
        name = obj["metadata"]["name"]
        assert len(name) <= 63 and not name.endswith("-"), f"{obj['kind']} name {name!r}"


def test_chart_app_version_is_the_project_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


# --- the operator Deployment --------------------------------------------------------------------

def test_the_operator_runs_the_real_command_with_its_real_flags(helm: Helm):
    operator = container(helm.template("--set", "operator.watchNamespace=team-a"))
    assert operator["command"] == ["gemini", "operator", "run"]
    argv = [*operator["command"], *operator["args"]]
    assert unknown_part(argv) is None, unknown_part(argv)
    from gemini_cli import build_parser

    args = build_parser().parse_args(argv[1:])  # exits on a flag the command does not have
    assert args.namespace == "team-a"
    assert args.lease_namespace == "gemini-system"
    assert args.sidecar_image == "gemini-sidecar:0.1.0"
    assert args.metrics_port == 9090
    assert args.health_port == 8081
    assert args.status_inline_bytes == 64 * 1024


def test_the_status_inline_limit_is_a_value(helm: Helm):
    operator = container(helm.template("--set", "operator.statusInlineBytes=0"))
    assert "--status-inline-bytes=0" in operator["args"]


def test_the_operator_container_is_non_root_read_only_and_probed(helm: Helm):
    objects = helm.template()
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    operator = container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    ctx = operator["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert operator["resources"]["requests"] and operator["resources"]["limits"]
    ports = {p["name"]: p["containerPort"] for p in operator["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert operator[probe]["httpGet"]["port"] in ports, f"{probe} names an undeclared port"
    # The health endpoints on their own port (gemini_operator.runtime.health), which a flood
    # of connections to the metrics or hint port cannot starve.
    assert {operator[p]["httpGet"]["port"] for p in (
        "startupProbe", "livenessProbe", "readinessProbe")} == {"health"}
    assert ports["health"] == 8081 and ports["metrics"] == 9090
    assert operator["startupProbe"]["httpGet"]["path"] == health.HEALTHZ_PATH
    assert operator["livenessProbe"]["httpGet"]["path"] == health.HEALTHZ_PATH
    assert operator["readinessProbe"]["httpGet"]["path"] == health.READYZ_PATH
    writable = {m["mountPath"] for m in operator["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert env["TMPDIR"] in writable


def test_host_network_is_off_by_default_and_resolves_cluster_names_when_on(helm: Helm):
    pod = one(helm.template(), "Deployment")["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    pod = one(helm.template("--set", "hostNetwork=true"), "Deployment")["spec"]["template"][
        "spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # the hints Service's name resolves


def test_the_deployment_matches_the_operator_image(helm: Helm):
    """Same command as the image's entrypoint, same uid as the image's user."""
    objects = helm.template()
    stages = dockerfile.stages((ROOT / "Dockerfile").read_text())
    operator_stage = next(s for s in stages if s.name == "operator")
    entrypoint, user = operator_stage.last("ENTRYPOINT"), operator_stage.last("USER")
    assert entrypoint is not None and user is not None
    assert container(objects)["command"] == entrypoint.words()
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == user.args.split(":")[0]


def test_image_tag_digest_and_sidecar_image_are_configurable(helm: Helm):
    operator = container(helm.template(
        "--set", "image.repository=registry.example/gemini-operator",
        "--set", "image.digest=sha256:" + "a" * 64,
        "--set", "sidecarImage.repository=registry.example/sidecar,sidecarImage.tag=1.2.3"))
    assert operator["image"] == "registry.example/gemini-operator@sha256:" + "a" * 64
    assert "--sidecar-image=registry.example/sidecar:1.2.3" in operator["args"]


def service_of(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    found = [o for o in by_kind(objects, "Service")
             if o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {component} Service, rendered {len(found)}"
    return found[0]


def test_the_metrics_service_selects_the_operator_pods(helm: Helm):
    objects = helm.template()
    service = service_of(objects, "metrics")
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in container(objects)["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names


def test_the_hints_service_reaches_the_operator_at_the_url_the_pods_are_given(helm: Helm):
    objects = helm.template()
    service = service_of(objects, "hints")
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(objects)["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] == "hints"
    args = build_run_args(container(objects)["args"])
    assert args.hint_port == ports["hints"] == service["spec"]["ports"][0]["port"] == 8090
    assert args.hint_url == (f"http://{service['metadata']['name']}.gemini-system.svc:"
                             f"{args.hint_port}")
    objects = helm.template("--set", "failureHints.enabled=false")
    assert [o for o in by_kind(objects, "Service")
            if o["metadata"]["labels"].get("app.kubernetes.io/component") == "hints"] == []
    args = build_run_args(container(objects)["args"])
    assert args.hint_port is None and args.hint_url is None


def test_a_hint_url_given_replaces_the_service_and_a_malformed_one_is_refused(helm: Helm):
    # hostNetwork on a cluster without kube-proxy or DNS: pods reach the node's address.
    objects = helm.template("--set", "hostNetwork=true",
                            "--set", "failureHints.url=http://10.250.50.1:8090")
    args = build_run_args(container(objects)["args"])
    assert (args.hint_port, args.hint_url) == (8090, "http://10.250.50.1:8090")
    assert not [o for o in by_kind(objects, "Service")
                if o["metadata"]["labels"].get("app.kubernetes.io/component") == "hints"]
    # The pod's own address, expanded by the kubelet from the downward API.
    objects = helm.template("--set", "failureHints.url=http://$(GEMINI_POD_IP):8090")
    env = {e["name"]: e for e in container(objects)["env"]}
    assert env["GEMINI_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert build_run_args(container(objects)["args"]).hint_url == \
        "http://$(GEMINI_POD_IP):8090"
    for bad in ("10.250.50.1:8090", "http://host:8090/v1/hints"):
        with pytest.raises(RenderError, match="failureHints/url"):
            helm.template("--set", f"failureHints.url={bad}")


# --- PriorityClasses of GeminiJob pods ------------------------------------------------------------

def test_the_chart_makes_the_priority_classes_the_operator_names(helm: Helm):
    objects = helm.template()
    classes = {o["metadata"]["name"]: o for o in by_kind(objects, "PriorityClass")}
    args = build_run_args(container(objects)["args"])
    assert args.create_priority_classes is False  # the operator needs no right to make them
    worker, spare = classes[args.worker_priority_class], classes[args.spare_priority_class]
    assert worker["value"] > spare["value"] and spare["preemptionPolicy"] == "Never"
    objects = helm.template("--set", "priorityClasses.create=false,priorityClasses.worker.name=w")
    assert not by_kind(objects, "PriorityClass")
    assert build_run_args(container(objects)["args"]).worker_priority_class == "w"
    with pytest.raises(RenderError, match="must be below"):
        helm.template("--set", "priorityClasses.spare.value=1000")


def build_run_args(args: list[str]) -> Any:
    from gemini_cli import build_parser

    return build_parser().parse_args(["operator", "run", *args])


# --- RBAC ---------------------------------------------------------------------------------------

def operator_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's own Roles and ClusterRoles (not those aggregated to view and edit)."""
    return [o for kind in ("ClusterRole", "Role") for o in by_kind(objects, kind)
            if not any(k.startswith("rbac.authorization.k8s.io/aggregate-to-")
                       for k in o["metadata"].get("labels") or {})]


def rbac_rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for o in operator_roles(objects) for r in o["rules"]]


def test_rbac_has_no_wildcards_and_no_escalation_verbs(helm: Helm):
    objects = helm.template()
    every = [r for kind in ("ClusterRole", "Role") for o in by_kind(objects, kind)
             for r in o["rules"]]
    assert len(every) > len(rbac_rules(objects))  # the aggregated roles' too
    for rule in every:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), f"wildcard in {rule}"
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        assert "nonResourceURLs" not in rule


def test_rbac_grants_exactly_what_an_operator_of_gemini_jobs_needs(helm: Helm):
    granted = {(g, res): set(r["verbs"]) for r in rbac_rules(helm.template())
               for g in r["apiGroups"] for res in r["resources"]}
    assert granted == {
        ("gemini.io", "geminijobs"): {"get", "list", "watch", "delete"},
        ("gemini.io", "geminijobs/status"): {"get", "patch", "update"},
        ("gemini.io", "geminijobs/finalizers"): {"update"},
        ("", "pods"): {"create", "delete", "get", "list", "watch", "patch"},
        ("", "pods/status"): {"get"},
        ("", "services"): {"create", "get"},
        ("", "secrets"): {"create"},  # job tokens are derived from a key: no Secret is read
        ("", "configmaps"): {"create", "get", "update"},  # large status detail (rank_detail)
        ("", "events"): {"create", "patch"},
        ("networking.k8s.io", "networkpolicies"): {"create", "get"},
        ("", "nodes"): {"get", "list", "watch"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
        ("coordination.k8s.io", "leases"): {"create", "get", "update"},
        # queued jobs (queueing.py)
        ("kueue.x-k8s.io", "workloads"): {"create", "get", "delete", "list", "watch"},
        ("kueue.x-k8s.io", "workloads/status"): {"patch"},
        ("kueue.x-k8s.io", "resourceflavors"): {"get"},
        ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"},
        ("scheduling.k8s.io", "priorityclasses"): {"get"},
    }


def test_job_tokens_come_from_a_kept_key_unless_read_back_is_chosen(helm: Helm):
    objects = helm.template()
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"]["key"])) >= 32
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GEMINI_OPERATOR_TOKEN_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"], "key": "key"}
    legacy = helm.template("--set", "tokenKey.derive=false")
    assert not [o for o in legacy if o["kind"] == "Secret"]
    granted = {(g, res): set(r["verbs"]) for r in rbac_rules(legacy)
               for g in r["apiGroups"] for res in r["resources"]}
    assert granted[("", "secrets")] == {"create", "get"}


def test_the_lease_holder_is_the_pod_so_a_restarted_container_leads_at_once(helm: Helm):
    env = {e["name"]: e for e in container(helm.template())["env"]}
    fields = {n: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
              for n, e in env.items()}
    assert fields["GEMINI_POD_NAME"] == "metadata.name", env
    assert fields["GEMINI_POD_UID"] == "metadata.uid", env
    assert env[IDENTITY_ENV]["value"] == "$(GEMINI_POD_NAME)_$(GEMINI_POD_UID)", env
    names = list(env)  # a $(VAR) reference resolves only to a variable defined before it
    assert names.index(IDENTITY_ENV) > max(names.index("GEMINI_POD_NAME"),
                                           names.index("GEMINI_POD_UID"))


def test_watching_one_namespace_adds_only_listing_namespaces(helm: Helm):
    """kopf finds the namespace it watches by listing namespaces; cluster-wide it does not."""
    default = rbac_rules(helm.template())
    narrowed = rbac_rules(helm.template("--set", "operator.watchNamespace=team-a"))
    added = [r for r in narrowed if r not in default]
    assert added == [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}]
    assert all(r in narrowed for r in default)


def test_leases_are_granted_only_in_the_release_namespace(helm: Helm):
    objects = helm.template(namespace="ops")
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == "ops"
    (cluster_role,) = [o for o in operator_roles(objects) if o["kind"] == "ClusterRole"]
    assert all("leases" not in r["resources"] for r in cluster_role["rules"])


def test_rbac_binds_the_operators_service_account(helm: Helm):
    objects = helm.template("--set", "serviceAccount.name=gemini-op")
    account = one(objects, "ServiceAccount")["metadata"]["name"]
    assert account == "gemini-op"
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account
    for binding in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": "gemini-system"}]


def test_an_existing_service_account_must_be_named(helm: Helm):
    with pytest.raises(RenderError, match=r"serviceAccount\.name is required"):
        helm.template("--set", "serviceAccount.create=false")
    objects = helm.template("--set", "serviceAccount.create=false,serviceAccount.name=mine")
    assert not by_kind(objects, "ServiceAccount")


def test_rbac_can_be_left_to_the_cluster_admin(helm: Helm):
    objects = helm.template("--set", "rbac.create=false")
    assert not [o for o in objects if o["kind"].endswith(("Role", "RoleBinding"))]


# --- monitoring ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key, kind", [("serviceMonitor", "ServiceMonitor"),
                                       ("podMonitor", "PodMonitor"),
                                       ("operatorPodMonitor", "PodMonitor"),
                                       ("prometheusRule", "PrometheusRule")])
def test_monitors_are_refused_with_a_clear_message_without_their_api(helm: Helm, key, kind):
    with pytest.raises(RenderError) as err:
        helm.template("--set", f"{key}.enabled=true")
    message = str(err.value)
    assert f"{key}.enabled is true" in message
    assert f"{MONITORING} {kind}" in message and f"{key}.enabled=false" in message
    # Another kind of the same group is not enough.
    other = "PodMonitor" if kind == "ServiceMonitor" else "ServiceMonitor"
    with pytest.raises(RenderError):
        helm.template("--set", f"{key}.enabled=true", "--api-versions", f"{MONITORING}/{other}")


def test_the_service_monitor_scrapes_the_metrics_service(helm: Helm):
    objects = helm.template("--set", "serviceMonitor.enabled=true",
                            "--set", "serviceMonitor.labels.release=kps",
                            "--api-versions", f"{MONITORING}/ServiceMonitor")
    monitor, service = one(objects, "ServiceMonitor"), service_of(objects, "metrics")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["gemini-system"]}
    # The target's `job` and `namespace` win: the operator's per-job series use other names.
    assert all("honorLabels" not in e for e in monitor["spec"]["endpoints"])


def test_the_service_monitor_needs_the_metrics_service(helm: Helm):
    with pytest.raises(RenderError, match=r"metrics\.service\.enabled"):
        helm.template("--set", "serviceMonitor.enabled=true,metrics.service.enabled=false",
                      "--api-versions", f"{MONITORING}/ServiceMonitor")


def test_the_operator_pod_monitor_scrapes_the_operator_pods_under_the_services_job(helm: Helm):
    objects = helm.template("--set", "operatorPodMonitor.enabled=true,prometheusRule.enabled=true",
                            "--api-versions", f"{MONITORING}/PodMonitor", *RULE_API)
    (monitor,) = [o for o in by_kind(objects, "PodMonitor")
                  if o["metadata"]["name"] == "gemini-gemini-operator"]
    pod = one(objects, "Deployment")["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["port"] in ports and "honorLabels" not in endpoint
    # The same `job` as the ServiceMonitor's scrape (the metrics Service's name): the rules
    # select the operator's series by it, and GeminiOperatorDown is rendered.
    service = service_of(helm.template(), "metrics")["metadata"]["name"]
    assert endpoint["relabelings"] == [
        {"action": "replace", "targetLabel": "job", "replacement": service}]
    down = alerts_of(objects)["GeminiOperatorDown"]["expr"]
    assert f'job="{service}"' in down


def test_one_monitor_of_the_operator_at_a_time(helm: Helm):
    with pytest.raises(RenderError, match="enable one of them"):
        helm.template("--set", "operatorPodMonitor.enabled=true,serviceMonitor.enabled=true",
                      "--api-versions", f"{MONITORING}/PodMonitor",
                      "--api-versions", f"{MONITORING}/ServiceMonitor")


def test_the_pod_monitor_scrapes_the_sidecar_of_every_worker_pod_the_operator_renders(helm: Helm):
    monitor = one(helm.template("--set", "podMonitor.enabled=true", "--api-versions",
                                f"{MONITORING}/PodMonitor"), "PodMonitor")
    spec = parse_spec(make_job("train").spec(), "gemini-sidecar:0.1.0")
    pod = render.worker_pod(render.JobRef("train", "ns", "uid"), spec, rank=0, attempt=0,
                            config=render.RenderConfig())
    sidecar = next(c for c in pod["spec"]["initContainers"]
                   if c["name"] == naming.SIDECAR_CONTAINER)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == naming.TRAINER_CONTAINER)
    assert [e["port"] for e in endpoints] == [
        next(p["name"] for p in sidecar["ports"] if p["name"] == endpoints[0]["port"]),
        next(p["name"] for p in trainer["ports"] if p["name"] == endpoints[1]["port"])]
    assert all(e["path"] == "/metrics" for e in endpoints)
    # A pod's own labels never override the scrape's (namespace, pod, job, ...): a pod could
    # forge them. Its series name their GeminiJob by geminijob_namespace and geminijob.
    assert all("honorLabels" not in e for e in endpoints)


RULE_API = ["--api-versions", f"{MONITORING}/PrometheusRule"]
ALERTS = {"GeminiJobNotRecoverableFromMemory", "GeminiJobRecoveryTooLong",
          "GeminiJobS3PersistenceStale", "GeminiJobS3PersistenceFailing",
          "GeminiSidecarMemoryNearBudget", "GeminiJobReplicationLagging", "GeminiOperatorDown",
          "GeminiOperatorReconcileErrors"}


def alerts_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rule = one(objects, "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_the_prometheus_rule_alerts_with_runbooks_and_severities(helm: Helm):
    objects = helm.template("--set", "prometheusRule.enabled=true,serviceMonitor.enabled=true",
                            "--set", "prometheusRule.labels.release=kps",
                            "--set", "prometheusRule.alertLabels.team=training",
                            *RULE_API, "--api-versions", f"{MONITORING}/ServiceMonitor")
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["metadata"]["namespace"] == "gemini-system"
    alerts = alerts_of(objects)
    assert set(alerts) == ALERTS
    headings = re.findall(r"^#+ `?(\w+)`?$", (ROOT / "docs" / "troubleshooting.md").read_text(),
                          re.MULTILINE)
    # The operator's series are this release's Service's scrape (the ServiceMonitor's job).
    service = service_of(objects, "metrics")["metadata"]["name"]
    scrape = {"job": f'="{service}"', "namespace": '="gemini-system"'}
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in {"critical", "warning"}, name
        assert alert["labels"]["team"] == "training", name
        notes = alert["annotations"]
        assert notes["summary"] and notes["description"], name
        assert notes["runbook_url"] == f"docs/troubleshooting.md#{name.lower()}", name
        assert name in headings, f"docs/troubleshooting.md has no runbook section for {name}"
        # A target label selects only the operator's scrape; jobs go by their own labels.
        for metric, matchers in selectors(alert["expr"]):
            targets = {k: v for k, v in matchers.items() if k in TARGET_LABELS}
            assert targets in ({}, scrape), (name, metric, matchers)
            assert targets or not metric.startswith(("gemini_operator_", "up")), (name, metric)


def test_the_prometheus_rule_takes_its_thresholds_from_values(helm: Helm):
    alerts = alerts_of(helm.template(
        "--set", "prometheusRule.enabled=true",
        "--set", "prometheusRule.alerts.recoveryTooLong.seconds=30",
        "--set", "prometheusRule.alerts.recoveryTooLong.for=0",
        "--set", "prometheusRule.alerts.replicationLagging.steps=3",
        "--set-json", "prometheusRule.alerts.sidecarMemoryNearBudget.ratio=0.5",
        "--set", "prometheusRule.alerts.s3PersistenceStale.intervals=3",
        "--set", "prometheusRule.alerts.s3PersistenceFailing.enabled=false",
        "--set", "prometheusRule.alerts.reconcileErrors.severity=info",
        "--set", "prometheusRule.runbookURL=https://docs.example/troubleshooting",
        *RULE_API))
    assert "> 30\n" in alerts["GeminiJobRecoveryTooLong"]["expr"]
    assert alerts["GeminiJobRecoveryTooLong"]["for"] == "0"
    assert alerts["GeminiJobReplicationLagging"]["for"] == "10m"
    assert "> 3\n" in alerts["GeminiJobReplicationLagging"]["expr"]
    assert alerts["GeminiSidecarMemoryNearBudget"]["expr"].endswith("> 0.5")
    assert "> 3 * gemini_operator_persist_interval_seconds" in alerts[
        "GeminiJobS3PersistenceStale"]["expr"]
    assert alerts["GeminiOperatorReconcileErrors"]["labels"]["severity"] == "info"
    assert alerts["GeminiJobNotRecoverableFromMemory"]["annotations"]["runbook_url"] == (
        "https://docs.example/troubleshooting#geminijobnotrecoverablefrommemory")
    # Off: that alert; without the ServiceMonitor: the one that reads its `up`.
    assert "GeminiJobS3PersistenceFailing" not in alerts
    assert "GeminiOperatorDown" not in alerts


# --- dashboard and CRD --------------------------------------------------------------------------

def test_the_dashboard_configmap_carries_the_dashboard_for_the_grafana_sidecar(helm: Helm):
    configmap = one(helm.template("--set", "dashboards.namespace=monitoring"), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    source = (CHART / "dashboards" / "gemini-operator.json").read_text()
    assert json.loads(configmap["data"]["gemini-operator.json"]) == json.loads(source)


def test_the_chart_crd_is_the_repository_crd():
    copy = CHART / "files" / "crds" / "geminijob.yaml"
    source = ROOT / "crds" / "geminijob.yaml"
    assert copy.read_bytes() == source.read_bytes(), (
        "the chart's CRD differs from crds/geminijob.yaml: run "
        "`cp crds/geminijob.yaml helm/gemini-operator/files/crds/geminijob.yaml`")


def test_the_crd_template_renders_the_crd_unchanged_and_kept_on_uninstall(helm: Helm):
    crd = one(helm.template(), "CustomResourceDefinition")
    source = yaml.safe_load((ROOT / "crds" / "geminijob.yaml").read_text())
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["name"] == source["metadata"]["name"]
    assert source["metadata"]["labels"].items() <= crd["metadata"]["labels"].items()
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    not_kept = one(helm.template("--set", "crds.keep=false"), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in not_kept["metadata"].get("annotations", {})
    assert not by_kind(helm.template("--set", "crds.install=false"), "CustomResourceDefinition")


# --- values and their schema --------------------------------------------------------------------

BAD_VALUES = [
    pytest.param(["--set", "replicaCount=4"], "replicaCount", id="at most three replicas"),
    pytest.param(["--set", "metrics.port=0"], "metrics/port", id="a port is 1-65535"),
    pytest.param(["--set", "metrics.port=70000"], "metrics/port", id="a port is at most 65535"),
    pytest.param(["--set", "imagePullPolicy=Always"], "additional properties",
                 id="unknown keys are refused, not ignored"),
    pytest.param(["--set", "image.pullPolicy=Sometimes"], "pullPolicy", id="pull policy enum"),
    pytest.param(["--set", "image.digest=latest"], "digest", id="a digest is sha256:<64 hex>"),
    pytest.param(["--set", "image.repository="], "repository", id="the image is required"),
    pytest.param(["--set", "serviceMonitor.interval=30 seconds"], "interval",
                 id="intervals are Prometheus durations"),
    pytest.param(["--set", "operator.logLevel=verbose"], "logLevel", id="log level enum"),
    pytest.param(["--set", "prometheusRule.alerts.operatorDown.for=5 minutes"], "for",
                 id="an alert's for is a Prometheus duration"),
    pytest.param(["--set", "prometheusRule.alerts.sidecarMemoryNearBudget.ratio=2"], "ratio",
                 id="a memory ratio is at most 1"),
    pytest.param(["--set", "prometheusRule.alerts.operatorDown.for=5"], "for",
                 id="a bare number is no duration (but 0 is)"),
    pytest.param(["--set", "prometheusRule.alerts.typo.for=1m"], "additional properties",
                 id="unknown alerts are refused"),
    pytest.param(["--set", "crds.install=yes please"], "install", id="booleans are booleans"),
    pytest.param(["--set", "fullnameOverride=Not_A_DNS_Label"], "fullnameOverride",
                 id="names are DNS labels"),
    pytest.param(["--set", "operator.watchNamespace=" + "n" * 64], "watchNamespace",
                 id="a namespace name has at most 63 characters"),
]


@pytest.mark.parametrize("args, fragment", BAD_VALUES)
def test_the_schema_rejects_bad_values(helm: Helm, args, fragment):
    with pytest.raises(RenderError, match=re.escape(fragment)):
        helm.template(*args)


def _documented_keys(lines: list[str]) -> list[str]:
    """Keys of values.yaml that lack a `# --` comment and have no documented children."""
    keys: list[tuple[int, str, bool]] = []  # (indent, path, has `# --` above)
    stack: list[tuple[int, str]] = []
    comment = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
            continue
        if not stripped or stripped.startswith("#"):
            continue
        match = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if match is None:  # a list item or a continued value
            comment = False
            continue
        indent = len(match[1])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([p for _, p in stack] + [match[2]])
        keys.append((indent, path, comment))
        stack.append((indent, match[2]))
        comment = False
    documented = {path for _, path, has in keys if has}

    def covered(path: str) -> bool:
        parts = path.split(".")
        if any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1)):
            return True
        children = [p for _, p, _ in keys if p.startswith(path + ".")]
        return bool(children) and all(covered(c) for c in children if c.count(".") ==
                                      path.count(".") + 1)

    return [path for _, path, _ in keys if not covered(path)]


def test_every_values_key_is_documented():
    undocumented = _documented_keys((CHART / "values.yaml").read_text().splitlines())
    assert not undocumented, f"values.yaml keys without a `# --` comment: {undocumented}"


def test_the_documentation_check_finds_an_undocumented_key():
    assert _documented_keys(["a:", "  # -- b", "  b: 1", "  c: 2", "# -- d", "d:", "  e: 3"]) \
        == ["a", "a.c"]


def test_the_schema_describes_every_default_value():
    """Every key in values.yaml is in the schema (which refuses unknown keys)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if not isinstance(value, dict) or "properties" not in node:
            return
        for key, child in value.items():
            assert key in node["properties"], f"{path}{key} is not in values.schema.json"
            walk(child, node["properties"][key], f"{path}{key}.")

    walk(values, schema, "")


def test_the_operator_pods_network_policy_admits_hints_only_from_worker_pods(helm: Helm):
    objects = helm.template()
    policy = one(objects, "NetworkPolicy")
    pod = one(objects, "Deployment")["spec"]["template"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    assert rules["health"] is None and rules["metrics"] is None  # the kubelet; any scraper
    (workers,) = rules["hints"]
    assert workers == {"namespaceSelector": {},
                       "podSelector": {"matchLabels": {naming.LABEL_MANAGED_BY: naming.MANAGER}}}
    assert naming.worker_labels("llm", 0, 0)[naming.LABEL_MANAGED_BY] == naming.MANAGER
    monitoring = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    policy = one(helm.template("--set-json", f"operatorNetworkPolicy.metricsFrom="
                               f"{json.dumps(monitoring)}", "--set", "failureHints.enabled=false"),
                 "NetworkPolicy")
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    assert rules == {"health": None, "metrics": monitoring}
    assert not [o for o in helm.template("--set", "operatorNetworkPolicy.enabled=false")
                if o["kind"] == "NetworkPolicy"]


def test_geminijobs_join_the_default_view_edit_and_admin_roles(helm: Helm):
    roles = {o["metadata"]["name"]: o for o in helm.template() if o["kind"] == "ClusterRole"}
    view, edit = roles["gemini-gemini-operator-view"], roles["gemini-gemini-operator-edit"]
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k for k, v in view["metadata"]["labels"].items() if v == "true"} >= {
        aggregate + "view", aggregate + "edit", aggregate + "admin"}
    assert aggregate + "view" not in edit["metadata"]["labels"]  # viewers do not write
    assert view["rules"][0]["verbs"] == ["get", "list", "watch"]
    assert "create" in edit["rules"][0]["verbs"] and "delete" in edit["rules"][0]["verbs"]
    assert not [o for o in helm.template("--set", "rbac.aggregateToDefaultRoles=false")
                if o["metadata"]["name"].endswith(("-view", "-edit"))]


def test_a_disruption_budget_keeps_one_replica_once_there_is_a_standby(helm: Helm):
    assert not by_kind(helm.template(), "PodDisruptionBudget")  # one replica: nothing to keep
    objects = helm.template("--set", "replicaCount=2")
    budget = one(objects, "PodDisruptionBudget")
    pod = one(objects, "Deployment")["spec"]["template"]
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
