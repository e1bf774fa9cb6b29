"""The label names every component's Prometheus metrics share (stdlib only).

Every per-job series, from the operator, the sidecars and the launchers, names its GeminiJob
with `geminijob_namespace` and `geminijob`; the sidecars' and launchers' also carry `rank`.
None of them exports a label a scrape sets on its own (`TARGET_LABELS`): Prometheus would rename
ours `exported_<name>` (or, with honorLabels, let a pod write the scrape's own labels). See
docs/metrics.md.
"""

from __future__ import annotations

import platform
from importlib import metadata

import gemini

JOB_NAMESPACE = "geminijob_namespace"
JOB = "geminijob"
RANK = "rank"
# The labels Prometheus (and the Prometheus Operator's monitors) set on every scraped series.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "endpoint",
                           "service"})
# Where GEMINI_NAMESPACE is not set (a sidecar or launcher started by hand, not by the
# operator): the namespace its metrics and S3 keys name.
DEFAULT_NAMESPACE = "default"


def build_labels() -> dict[str, str]:
    """The labels of every component's `*_build_info` series: what runs."""
    return {"version": version(), "python_version": platform.python_version()}


def version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    try:
        return metadata.version("gemini-operator")
    except metadata.PackageNotFoundError:
        return gemini.__version__
