"""The Prometheus metrics the project really exports, read from the registries its code builds.

Each component defines its metrics in a registry of its own (its `metrics.py`); an adapter here
builds that registry the way the running component does. A shipped module that defines
metrics without an adapter is an error (`unread_metrics_modules`), so a new component's
metrics cannot be forgotten.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = (ROOT / "gemini", ROOT / "operator", ROOT / "trainer_sidecar", ROOT / "cli")


def _sidecar() -> CollectorRegistry:
    from gemini_sidecar.metrics import make_metrics

    return make_metrics(namespace="ns", job="job", rank=0).registry


def _operator() -> CollectorRegistry:
    from gemini_operator.core.conditions import State
    from gemini_operator.core.status import CheckpointStatus, ReplicaCoverage
    from gemini_operator.runtime.metrics import JobReport, OperatorMetrics

    metrics = OperatorMetrics()  # a job known in every per-job series, so each has samples
    checkpoint = CheckpointStatus(persisted_time="2026-01-01T00:00:00Z",
                                  replica_coverage=ReplicaCoverage(3, 4, 7), recoverable_step=7,
                                  effective_interval=1, replication_lag_steps=0)
    metrics.reconciled(("ns", "job"), JobReport(State.RECOVERING, checkpoint, 1.0e9, 3600), 0.1)
    return metrics.registry


def _launcher() -> CollectorRegistry:
    from gemini_trainer.launcher_metrics import make_registry

    status = {"state": "running", "epoch": 2, "restarts": 2, "exit_code": 1, "warm": True,
              "started_at": 10.0, "progress": {"step": 3, "unix": 12.0, "age_s": 0.5}}
    return make_registry(lambda: status, namespace="ns", job="job", rank="0")


# Module (as a path under the repository) -> how its component builds its registry.
ADAPTERS: dict[str, Callable[[], CollectorRegistry]] = {
    "trainer_sidecar/gemini_sidecar/metrics.py": _sidecar,
    "operator/gemini_operator/runtime/metrics.py": _operator,
    "trainer_sidecar/gemini_trainer/launcher_metrics.py": _launcher,
}

# The sample names each family type exposes (prometheus_client's text format).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "unknown": ("",),
}


# prometheus_client's own collectors (ProcessCollector, PlatformCollector), which every
# component registers: standard names, not the project's.
STANDARD_PREFIXES = ("process_", "python_")


@dataclass(frozen=True)
class Family:
    name: str  # as prometheus_client names the family (counters without _total)
    type: str
    labels: frozenset[str]
    module: str

    def sample_names(self) -> set[str]:
        return {self.name + suffix for suffix in _SUFFIXES[self.type]}

    @property
    def standard(self) -> bool:
        """A family of prometheus_client's own collectors, not one of the project's."""
        return self.name.startswith(STANDARD_PREFIXES)


_METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}


def _defines_metrics(path: Path) -> bool:
    """Whether the module imports a metric type from prometheus_client."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("prometheus_client")
                and {alias.name for alias in node.names} & _METRIC_TYPES):
            return True
        if isinstance(node, ast.Import) and any(
                a.name.startswith("prometheus_client") for a in node.names):
            return True
    return False


def metrics_modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for d in SHIPPED for p in d.rglob("*.py")
                  if _defines_metrics(p))


def unread_metrics_modules() -> list[str]:
    return [m for m in metrics_modules() if m not in ADAPTERS]


def _declared_labels(registry: CollectorRegistry) -> dict[str, frozenset[str]]:
    """Label names as declared, also for labelled metrics with no child yet (no samples)."""
    out: dict[str, frozenset[str]] = {}
    for collector in list(registry._collector_to_names):
        names = frozenset(getattr(collector, "_labelnames", ()))
        described: list[Metric] = getattr(collector, "describe", list)()
        for metric in described:
            out[metric.name] = names
    return out


def families() -> Iterator[Family]:
    for module, build in ADAPTERS.items():
        registry = build()
        declared = _declared_labels(registry)
        for metric in registry.collect():
            sampled = frozenset(k for s in metric.samples for k in s.labels)
            labels = (sampled | declared.get(metric.name, frozenset())) - {"le", "quantile"}
            yield Family(metric.name, metric.type, labels, module)


def exported_sample_names() -> dict[str, Family]:
    """Every series name a scrape can show, and the family it belongs to."""
    return {name: fam for fam in families() for name in fam.sample_names()}
