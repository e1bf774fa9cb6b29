"""The Prometheus Operator's generated configuration, rewritten for a Prometheus on the host
(gemini_local.promconfig), and the files the reloader writes for it (gemini_local.promreload).
GENERATED is the shape the operator v0.93.0 writes (its Secret prometheus-local, trimmed)."""

from __future__ import annotations

import gzip
import textwrap
from pathlib import Path

import pytest
import yaml

from gemini_local import promconfig
from gemini_local.promreload import Generated, write_files

GENERATED = textwrap.dedent("""\
    global:
      scrape_interval: 2s
      external_labels:
        prometheus: monitoring/local
        prometheus_replica: $(POD_NAME)
      evaluation_interval: 2s
    rule_files:
    - /etc/prometheus/rules/prometheus-local-rulefiles-0/*.yaml
    scrape_configs:
    - job_name: serviceMonitor/demo/metrics-demo/0
      kubernetes_sd_configs:
      - role: endpoints
        namespaces:
          names:
          - demo
      tls_config:
        ca_file: /etc/prometheus/certs/secret_demo_ca_ca.crt
      relabel_configs:
      - source_labels:
        - __tmp_hash
        regex: $(SHARD)
        action: keep
    - job_name: podMonitor/demo/metrics-demo/0
      kubernetes_sd_configs:
      - role: pod
        api_server: https://10.0.0.1:443
    """)
KUBECONFIG = Path("/state/kubeconfig")
ETC = Path("/state/monitoring/etc-prometheus")


def rewritten() -> dict:
    text = promconfig.host_config(GENERATED, KUBECONFIG, ETC, promconfig.pod_variables("local"))
    return dict(yaml.safe_load(text))


def test_pod_variables_are_expanded_as_the_config_reloader_would():
    config = rewritten()
    assert config["global"]["external_labels"]["prometheus_replica"] == "prometheus-local-0"
    assert config["scrape_configs"][0]["relabel_configs"][0]["regex"] == "0"


def test_paths_under_etc_prometheus_move_to_the_state_dir():
    config = rewritten()
    assert config["rule_files"] == [f"{ETC}/rules/prometheus-local-rulefiles-0/*.yaml"]
    assert config["scrape_configs"][0]["tls_config"]["ca_file"] == \
        f"{ETC}/certs/secret_demo_ca_ca.crt"
    assert promconfig.rule_dir(ETC, "prometheus-local-rulefiles-0") == \
        ETC / "rules" / "prometheus-local-rulefiles-0"


def test_in_cluster_service_discovery_gets_the_kubeconfig_and_the_rest_is_kept():
    service, pod = rewritten()["scrape_configs"]
    assert service["kubernetes_sd_configs"] == [
        {"role": "endpoints", "namespaces": {"names": ["demo"]},
         "kubeconfig_file": str(KUBECONFIG)}]
    # An API server of its own (spec.apiserverConfig) is not the pod's in-cluster access.
    assert pod["kubernetes_sd_configs"] == [{"role": "pod", "api_server": "https://10.0.0.1:443"}]


def test_a_variable_only_the_pod_has_is_refused():
    with pytest.raises(promconfig.ConfigError, match=r"\$\(TOPOLOGY_ZONE\)"):
        promconfig.host_config("global:\n  external_labels:\n    zone: $(TOPOLOGY_ZONE)\n",
                               KUBECONFIG, ETC, promconfig.pod_variables("local"))


def test_the_secret_value_is_gzipped_yaml():
    assert promconfig.decode(gzip.compress(GENERATED.encode())) == GENERATED


def test_the_reloader_writes_rules_and_certs_and_drops_rule_files_no_longer_generated(tmp_path):
    first = Generated("", {"prometheus-local-rulefiles-0": {"a.yaml": b"groups: []\n"},
                           "prometheus-local-rulefiles-1": {"b.yaml": b"groups: []\n"}},
                      {"ca.crt": b"PEM"})
    write_files(first, tmp_path)
    assert (tmp_path / "rules" / "prometheus-local-rulefiles-1" / "b.yaml").exists()
    assert (tmp_path / "certs" / "ca.crt").read_bytes() == b"PEM"
    second = Generated("", {"prometheus-local-rulefiles-0": {"c.yaml": b"groups: []\n"}}, {})
    write_files(second, tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.yaml")) == [
        "rules/prometheus-local-rulefiles-0/c.yaml"]
    assert first.digest() != second.digest()
