"""The replication pace the operator reports: recoverable step, effective interval, lag, why;
and the events when the interval lengthens and comes back to every step."""

from __future__ import annotations

from gemini.control.inventory import Inventory
from gemini_operator.core.decide import interval_events
from gemini_operator.core.pace import replication_pace
from gemini_operator.core.status import CheckpointStatus, JobStatus

MIB = 1 << 20


def inventory(rank: int, notified: int, acked: int, interval: int, seconds: float = 0.0,
              size: int = 64 * MIB) -> Inventory:
    return Inventory.from_json({
        "job": "j", "rank": rank, "world_size": 2,
        "local": [{"rank": rank, "version": notified, "complete": True, "bytes": size,
                   "checksum": 1}],
        "replicas": [],
        "sending": {"mode": "immediate", "notified_version": notified, "skipped_versions": 0,
                    "fits_idle_spans": True, "interval_iterations": 1, "plan": "",
                    "peers": {str(1 - rank): {"acked_version": acked, "sending_version": -1,
                                              "last_error": "", "last_seconds": seconds}},
                    "acknowledged_version": acked, "effective_interval": interval},
        "memory": {"used_bytes": 0, "budget_bytes": 1},
        "placement": {"peers": {}, "hold_ranks": [], "send_to": []},
    })


def test_the_recoverable_step_is_the_oldest_acknowledged_and_the_interval_the_largest():
    pace = replication_pace({0: inventory(0, 12, 9, 3, 2.0), 1: inventory(1, 12, 12, 1, 0.5)})
    assert pace is not None
    assert (pace.recoverable_step, pace.effective_interval, pace.lag_steps) == (9, 3, 3)
    assert pace.reason == ("a version of 64.0 MiB reaches its peers in 2.00 s, 32.0 MiB/s "
                           "(rank 0, the slowest)")


def test_nothing_acknowledged_yet_has_no_recoverable_step():
    pace = replication_pace({0: inventory(0, 2, -1, 1), 1: inventory(1, 2, 1, 1)})
    assert pace is not None
    assert (pace.recoverable_step, pace.lag_steps) == (None, None)
    assert pace.reason == "no replication measured yet"
    assert replication_pace({}) is None


def test_older_sidecars_without_the_fields_read_as_keeping_up():
    doc = inventory(0, 5, 5, 1).to_json()
    del doc["sending"]["acknowledged_version"], doc["sending"]["effective_interval"]
    parsed = Inventory.from_json(doc)
    assert (parsed.sending.acknowledged_version, parsed.sending.effective_interval) == (-1, 1)


def test_an_event_when_the_interval_lengthens_and_when_it_is_restored():
    keeping_up = CheckpointStatus(recoverable_step=10, effective_interval=1)
    lagging = CheckpointStatus(recoverable_step=10, effective_interval=3,
                               interval_reason="a version of 64.0 MiB reaches ...")
    [longer] = interval_events(keeping_up, lagging)
    assert longer.reason == "CheckpointIntervalLengthened" and longer.warning
    assert "every 3 steps" in longer.message and "64.0 MiB" in longer.message
    assert "keep step 10" in longer.message
    assert interval_events(lagging, lagging) == []
    [back] = interval_events(lagging, CheckpointStatus(effective_interval=1))
    assert back.reason == "CheckpointIntervalRestored" and not back.warning


def test_the_pace_round_trips_through_the_status():
    status = JobStatus(checkpoint=CheckpointStatus(
        recoverable_step=7, effective_interval=2, interval_reason="why",
        replication_lag_steps=2))
    doc = status.to_dict()["checkpoint"]
    assert doc == {"recoverableStep": 7, "effectiveInterval": 2, "intervalReason": "why",
                   "replicationLagSteps": 2}
    assert JobStatus.from_dict(status.to_dict()).checkpoint == status.checkpoint
