"""The typed status records of placement, the last recovery and the spares: each writes the
document the CRD describes and reads it back to the same record, strictly."""

from __future__ import annotations

from typing import Any

import pytest

from gemini.domain.placement import mixed_placement
from gemini_operator.core.records import LastRecovery, PlacementRecord, SparesRecord
from gemini_operator.core.status import JobStatus

PLACEMENT = PlacementRecord(mixed_placement(4, 2), 1, {r: f"n{r}" for r in range(4)})
LAST = LastRecovery(
    cause="hardware", message="node n2 lost", source="Peers", failed_ranks=(2,), steps_lost=1,
    start_time="2026-11-29T18:00:00Z", detected_at=None, completion_time="2026-11-29T18:00:09Z",
    duration_seconds=8.765, duration_milliseconds=8765, epoch=3,
    breakdown={"planning": 0.5, "replacing": 7.0}, restored_step=40)
SPARES = SparesRecord(2, 1, ("n4",), "Creating", "1 of 2 spare nodes held; starting")


def test_the_placement_is_published_as_the_domains_document_with_its_attempt_and_nodes() -> None:
    doc = PLACEMENT.to_json()
    assert doc == {**mixed_placement(4, 2).to_dict(), "restartAttempt": 1,
                   "nodes": {"0": "n0", "1": "n1", "2": "n2", "3": "n3"}}
    assert PlacementRecord.from_json(doc) == PLACEMENT
    assert PLACEMENT.on({r: f"n{r}" for r in range(4)}) and not PLACEMENT.on({0: "n0"})
    moved = PLACEMENT.moved_to({**PLACEMENT.nodes, 2: "n9"})
    assert moved.layout == PLACEMENT.layout and moved.to_json()["nodes"]["2"] == "n9"


def test_the_last_recovery_keeps_every_key_and_names_a_fresh_start() -> None:
    doc = LAST.to_json()
    assert list(doc) == ["cause", "message", "source", "failedRanks", "stepsLost", "startTime",
                         "detectedAt", "completionTime", "durationSeconds",
                         "durationMilliseconds", "epoch", "breakdown", "restoredStep"]
    assert doc["detectedAt"] is None and doc["failedRanks"] == [2]
    assert LastRecovery.from_json(doc) == LAST
    stored = {k: v for k, v in doc.items() if v is not None}  # the API drops nulls
    assert LastRecovery.from_json(stored) == LAST
    fresh = LastRecovery.from_json({**stored, "restoredStep": None})
    assert "restoredStep" not in fresh.to_json() and fresh.restored == "none (fresh start)"
    assert LAST.restored == 40


def test_the_spares_record_round_trips() -> None:
    assert SPARES.to_json() == {"desired": 2, "ready": 1, "nodes": ["n4"], "reason": "Creating",
                                "message": "1 of 2 spare nodes held; starting"}
    assert SparesRecord.from_json(SPARES.to_json()) == SPARES


def test_the_status_carries_the_records_and_writes_their_documents() -> None:
    raw = {"placement": PLACEMENT.to_json(), "lastRecovery": LAST.to_json(),
           "spares": SPARES.to_json()}
    status = JobStatus.from_dict(raw)
    assert (status.placement, status.last_recovery, status.spares) == (PLACEMENT, LAST, SPARES)
    assert {k: status.to_dict()[k] for k in raw} == raw


@pytest.mark.parametrize("field, doc", [
    ("placement", {**PLACEMENT.to_json(), "holders": {"0": "n0"}}),
    ("placement", {**PLACEMENT.to_json(), "nodes": {"0": 3}}),
    ("lastRecovery", {**LAST.to_json(), "failedRanks": ["2"]}),
    ("spares", {**SPARES.to_json(), "ready": "1"}),
])
def test_a_record_of_the_wrong_shape_is_refused_naming_its_field(field: str, doc: Any) -> None:
    with pytest.raises(ValueError, match=f"status.{field}"):
        JobStatus.from_dict({field: doc})
