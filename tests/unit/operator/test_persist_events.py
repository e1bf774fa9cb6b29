"""Events about S3 persistence: one warning when it starts failing, one note when it works
again, nothing for the retries in between."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gemini_operator.core.decide import decide
from gemini_operator.core.status import CheckpointStatus, status_patch
from gemini_operator.core.types import JobView, Observed, ReconcileConfig
from tests.unit.operator.builders import make_job
from tests.unit.operator.test_decide import NODES, NOW

CONFIG = ReconcileConfig(default_sidecar_image="gemini:side")
OK = CheckpointStatus(in_memory_step=7, persisted_step=5, persisted_time="2026-11-29T18:00:00Z")
FAILING = CheckpointStatus(in_memory_step=8, persisted_step=5,
                           persisted_time="2026-11-29T18:00:00Z",
                           persist_error="step 8: connection refused")


def _reasons(job: dict[str, Any], checkpoint: CheckpointStatus
             ) -> tuple[list[tuple[str, bool]], dict[str, Any]]:
    observed = Observed(job=JobView.from_object(job), pods={}, nodes=NODES, has_service=False,
                        has_secret=False, now=NOW, checkpoint=checkpoint)
    decision = decide(observed, CONFIG)
    job["status"] = decision.status.to_dict()
    return [(e.reason, e.warning) for e in decision.events if "Persist" in e.reason], job


def test_persisting_that_starts_failing_is_a_warning_once_and_its_recovery_a_note() -> None:
    job = make_job().with_uid("uid-1").obj()
    job["metadata"]["generation"] = 1
    events, job = _reasons(job, OK)
    assert events == []
    events, job = _reasons(job, FAILING)
    assert events == [("PersistFailed", True)]
    assert job["status"]["checkpoint"]["persistError"] == "step 8: connection refused"
    retried = replace(FAILING, persist_error="step 9: timed out")
    events, job = _reasons(job, retried)
    assert events == []  # the retries change the message in status, not the event stream
    recovered = CheckpointStatus(in_memory_step=10, persisted_step=10,
                                 persisted_time="2026-11-29T18:01:00Z")
    events, job = _reasons(job, recovered)
    assert events == [("PersistRecovered", False)]
    assert "persistError" not in job["status"]["checkpoint"]


def test_the_status_patch_nulls_a_persist_error_that_is_gone_from_the_checkpoint() -> None:
    """The API server merges nested documents key by key: a key dropped from
    status.checkpoint stays there unless the patch nulls it."""
    old = {"checkpoint": FAILING.to_dict(), "restarts": 0}
    recovered = replace(FAILING, persisted_step=8, persist_error=None)
    patch = status_patch(old, {"checkpoint": recovered.to_dict(), "restarts": 0})
    assert patch == {"checkpoint": {"persistedStep": 8, "persistError": None}}
    assert status_patch(old, {"checkpoint": FAILING.to_dict(), "restarts": 0}) is None
