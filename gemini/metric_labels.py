"""The label names every component's Prometheus metrics share (stdlib only).

Every per-job series, from the operator, the sidecars and the launchers, names its GeminiJob
with `geminijob_namespace` and `geminijob`; the sidecars' and launchers' also carry `rank`.
None of them exports a label a scrape sets on its own (`TARGET_LABELS`): Prometheus would rename
ours `exported_<name>` (or, with honorLabels, let a pod write the scrape's own labels). See
docs/metrics.md.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Mapping
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


def namespace_from_env(env: Mapping[str, str], what: str) -> str:
    """GEMINI_NAMESPACE, the GeminiJob's namespace the operator sets on every worker
    container; unset (started by hand): DEFAULT_NAMESPACE, said in a warning naming `what`
    uses it."""
    namespace = env.get("GEMINI_NAMESPACE", "").strip()
    if not namespace:
        logging.getLogger(__name__).warning(
            "GEMINI_NAMESPACE is not set (the operator sets it on every worker pod): %s use %r",
            what, DEFAULT_NAMESPACE)
    return namespace or DEFAULT_NAMESPACE


def build_labels() -> dict[str, str]:
    """The labels of every component's `*_build_info` series: what runs."""
    return {"version": version(), "python_version": platform.python_version()}


def version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    try:
        return metadata.version("gemini-operator")
    except metadata.PackageNotFoundError:
        return gemini.__version__
