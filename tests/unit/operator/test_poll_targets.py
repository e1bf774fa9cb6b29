"""Which workers' sidecars the checkpoint poller asks: none once the job finished (their pods
keep their IPs; the poller retried a persist against them every 10 s for good)."""

from __future__ import annotations

from dataclasses import replace

from gemini_operator.calls.poller import workers_to_poll
from gemini_operator.calls.sidecars import relay_batches
from gemini_operator.core.observed import ContainerExit
from gemini_operator.core.status import JobStatus
from tests.unit.operator.test_decide import Harness, training_harness


def _started() -> Harness:
    return training_harness(owner_uid="uid-1")


def _targets(h: Harness) -> set[int] | None:
    found = workers_to_poll("uid-1", JobStatus.from_dict(h.job["status"]), h.pods)
    return None if found is None else set(found)


def test_running_workers_are_polled_and_finished_pods_are_not():
    h = _started()
    assert _targets(h) == {0, 1, 2, 3}
    h.pods[0] = replace(h.pods[0], phase="Succeeded", ready=False)
    h.step()
    assert _targets(h) == {1, 2, 3}
    h.pods[1] = replace(h.pods[1], owner_uid="another job of that name")
    assert _targets(h) == {2, 3}
    # Its trainer is done; the pod runs on until its sidecar stops: a persist would fail.
    h.pods[2] = replace(h.pods[2], trainer_exit=ContainerExit(0, "Completed"))
    assert _targets(h) == {3}
    h.pods[3] = replace(h.pods[3], trainer_exit=ContainerExit(1, "Error"))  # a failure
    assert _targets(h) == {3}


def test_a_finished_job_is_not_polled():
    h = _started()
    for rank in h.pods:
        h.pods[rank] = replace(h.pods[rank], phase="Succeeded", ready=False)
    h.step()
    assert h.status()["state"] == "Succeeded"
    assert _targets(h) is None


def test_nothing_is_polled_before_training_starts():
    h = Harness()
    h.step()
    h.run_pods(owner_uid="uid-1")
    h.step()
    assert _targets(h) is None


def test_large_jobs_are_polled_in_batches_of_about_the_square_root() -> None:
    small = relay_batches(list(range(64)))
    assert [len(b) for b in small] == [16] * 4  # at least 16 a batch
    big = relay_batches(list(range(8192)))
    assert len(big) == 91 and max(len(b) for b in big) == 91
    assert [r for b in big for r in b] == list(range(8192))
