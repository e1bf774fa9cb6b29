"""The Prometheus Operator's generated configuration, made to run on the host instead of in the
pod it was written for (pure functions; the reloader, gemini_local.promreload, does the I/O).

In its pod, Prometheus reads the operator's output through two things the host lacks: the
config-reloader sidecar, which expands `$(POD_NAME)`-style variables, and the pod's files
(the service account's in-cluster access for Kubernetes service discovery, the operator's
Secrets and ConfigMaps mounted under /etc/prometheus). `host_config` replaces both.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

POD_ETC = "/etc/prometheus"  # where the pod mounts the operator's Secrets and ConfigMaps
CONFIG_KEY = "prometheus.yaml.gz"  # the key of the generated config in Secret prometheus-<name>
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class ConfigError(ValueError):
    """The generated configuration cannot be run on the host; the message says why."""


def pod_variables(prometheus: str) -> dict[str, str]:
    """What the config-reloader would expand in the first shard's first pod of Prometheus
    `prometheus` (the operator's StatefulSet names it prometheus-<name>-0)."""
    return {"POD_NAME": f"prometheus-{prometheus}-0", "SHARD": "0", "NODE_NAME": "host"}


def decode(secret_value: bytes) -> str:
    """The generated configuration from its Secret's (already base64-decoded) value."""
    return gzip.decompress(secret_value).decode()


def host_config(text: str, kubeconfig: Path, etc_dir: Path,
                variables: Mapping[str, str]) -> str:
    """The operator's generated configuration `text`, rewritten for a Prometheus on the host:
    `$(VAR)`s expanded from `variables` (ConfigError on any other), every path under the pod's
    /etc/prometheus moved under `etc_dir` (where the reloader writes what the pod mounts), and
    Kubernetes service discovery given `kubeconfig` wherever it would use the pod's in-cluster
    access (no `api_server` of its own)."""
    config = yaml.safe_load(text) or {}
    if not isinstance(config, dict):
        raise ConfigError("the generated configuration is not a mapping")
    # In the strings, after parsing: `regex: $(SHARD)` must stay the string "0", not become 0.
    config = _rewritten(config, lambda s: _moved(_expand(s, variables), etc_dir))
    for job in config.get("scrape_configs") or []:
        for sd in job.get("kubernetes_sd_configs") or []:
            if "api_server" not in sd:
                sd["kubeconfig_file"] = str(kubeconfig)
    return str(yaml.safe_dump(config, sort_keys=False))


def _expand(text: str, variables: Mapping[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in variables:
            raise ConfigError(f"the configuration uses $({name}), which only its pod has")
        return variables[name]

    return _VARIABLE.sub(value, text)


def _rewritten(node: Any, rewrite: Callable[[str], str]) -> Any:
    """`node` with `rewrite` applied to every string value (not to keys)."""
    if isinstance(node, dict):
        return {key: _rewritten(value, rewrite) for key, value in node.items()}
    if isinstance(node, list):
        return [_rewritten(value, rewrite) for value in node]
    return rewrite(node) if isinstance(node, str) else node


def _moved(path: str, etc_dir: Path) -> str:
    """`path` moved under `etc_dir` if it is under /etc/prometheus."""
    if path == POD_ETC or path.startswith(POD_ETC + "/"):
        return str(etc_dir) + path[len(POD_ETC):]
    return path


def rule_dir(etc_dir: Path, configmap: str) -> Path:
    """Where the pod mounts rulefiles ConfigMap `configmap` (the generated rule_files' glob
    names it), under `etc_dir`."""
    return etc_dir / "rules" / configmap


def certs_dir(etc_dir: Path) -> Path:
    """Where the pod mounts the operator's TLS assets Secrets (scrape configs name files there)."""
    return etc_dir / "certs"
