"""The operator-facing docs cover what the code defines: every condition reason and failure
reason is explained in docs/troubleshooting.md, every exported metric in docs/metrics.md, and
the relative links of the packaging docs lead to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gemini_operator.core import conditions
from gemini_operator.core.failures import FailureReason
from tests.unit.packaging.metrics_registry import families

ROOT = Path(__file__).resolve().parents[3]
TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()
METRICS = (ROOT / "docs" / "metrics.md").read_text()
DOCS = [ROOT / "docs" / "install.md", ROOT / "docs" / "metrics.md",
        ROOT / "docs" / "troubleshooting.md", ROOT / "helm" / "gemini-operator" / "README.md"]
REASONS = sorted({r.reason for r in vars(conditions).values() if isinstance(r, conditions.Reason)})


def test_conditions_define_reasons():
    assert len(REASONS) >= 10


@pytest.mark.parametrize("reason", REASONS)
def test_every_condition_reason_is_explained(reason):
    assert f"| `{reason}` |" in TROUBLESHOOTING, (
        f"docs/troubleshooting.md has no table row for condition reason {reason}")


@pytest.mark.parametrize("reason", [r.value for r in FailureReason])
def test_every_failure_reason_is_explained(reason):
    assert f"| `{reason}` |" in TROUBLESHOOTING


@pytest.mark.parametrize("family", list(families()), ids=lambda f: f.name)
def test_every_exported_metric_is_documented(family):
    name = family.name + ("_total" if family.type == "counter" else "")
    assert f"`{name}`" in METRICS, f"docs/metrics.md does not describe {name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(doc):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
