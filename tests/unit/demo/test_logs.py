"""Following rank 0's trainer output on the local nodes, and when training resumed."""

from __future__ import annotations

from pathlib import Path

from gemini_demo.logs import StepLine, StepLog, resumption
from gemini_demo.session import downtime_breakdown, iteration_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _log_file(state: Path, node: str, uid: str, run: int) -> Path:
    path = state / f"nodes/{node}/pods/ns_job-worker-0_{uid}/logs/trainer/{run}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_lines_are_read_incrementally_across_restarts_and_replacement_pods(
    tmp_path: Path,
) -> None:
    clock = Clock()
    log = StepLog(tmp_path, "ns", "job-worker-0", clock=clock)
    first = _log_file(tmp_path, "node-0", "aaa", 0)
    first.write_text("deepspeed noise\nstep 1 loss 0x1.0p+1\nstep 2 loss 0x1.")
    assert [(s.step, s.generation) for s in log.poll()] == [(1, 1)]
    clock.now = 1.0
    with open(first, "a") as f:
        f.write("8p+0\nrestored step 2 extra {}\nstep 3 loss 0x1.4p+0\n")
    lines = log.poll()
    assert [(s.step, s.loss, s.generation, s.seen_at) for s in lines] == [
        (2, "0x1.8p+0", 1, 1.0), (3, "0x1.4p+0", 2, 1.0)]
    clock.now = 2.0
    # The pod was replaced on another node: a new file is a new process.
    _log_file(tmp_path, "node-5", "bbb", 0).write_text("step 3 loss 0x1.4p+0\n")
    (new,) = log.poll()
    assert (new.step, new.generation) == (3, 3)
    assert log.losses() == [(1, "0x1.0p+1"), (2, "0x1.8p+0"), (3, "0x1.4p+0"), (3, "0x1.4p+0")]
    assert log.poll() == []


def _line(at: float, step: int, generation: int = 1) -> StepLine:
    return StepLine(at, step, "0x1.0p+0", generation)


def test_resumption_is_the_first_step_of_a_new_process_after_the_failure() -> None:
    lines = [_line(1, 1), _line(2, 2), _line(3, 3), _line(10, 3, 2), _line(11, 4, 2)]
    resumed, newest = resumption(lines, injected_at=2.5, generation_at_injection=1) or (None, 0)
    assert resumed == lines[3] and newest == 3


def test_a_step_printed_by_the_old_process_after_the_failure_is_not_a_resumption() -> None:
    # Rank 0 finished the step in flight before the crash reached it.
    lines = [_line(1, 1), _line(2, 2), _line(2.6, 3)]
    assert resumption(lines, injected_at=2.5, generation_at_injection=1) is None
    # A replay in the same file (an in-place restart from nothing) is a resumption too.
    lines.append(_line(9, 1))
    assert resumption(lines, 2.5, 1) == (lines[3], 3)


def test_iteration_time_is_the_median_gap_between_consecutive_steps_of_one_process() -> None:
    lines = [_line(0, 1), _line(1, 2), _line(2, 3), _line(30, 3, 2), _line(31.5, 4, 2),
             _line(32.5, 5, 2)]
    assert iteration_seconds(lines) == 1.0
    assert iteration_seconds([]) == 0.0


def test_the_downtime_breaks_down_into_detection_operator_phases_and_trainer_restart() -> None:
    recovery = {"durationSeconds": 1.0, "breakdown": {"planning": 0.25, "restarting": 0.75}}
    parts = downtime_breakdown(10.0, 11.5, 20.0, recovery)
    assert parts == {"detection": 1.5, "planning": 0.25, "restarting": 0.75,
                     "trainer_restart": 7.5}
    assert sum(parts.values()) == 20.0 - 10.0
    assert downtime_breakdown(10.0, None, 20.0, recovery) == {}


def test_detection_prefers_the_operators_own_clock_over_what_the_watch_saw() -> None:
    from gemini_demo.session import RecoveringWatch

    watch = RecoveringWatch(custom=None, core=None, clock=lambda: 0.0)
    watch.turned = [3.0, 12.0]  # demo clock: when the watches saw a recovery declared
    assert watch.first_after(10.0) == 12.0
    assert watch.first_after(13.0) is None
    # The operator declared one 0.4 s after an injection at Unix 1000.0 (demo clock 10.0).
    watch.started_unix = {990.0, 1000.4}
    first = watch.first_after(10.0, wall=1000.0)
    assert first is not None and abs(first - 10.4) < 1e-9


def test_a_real_kubelets_cri_log_lines_are_read_like_a_node_agents(tmp_path: Path) -> None:
    """A kubelet node keeps each container's output under its podLogsDir, each line prefixed
    with its time, stream and tag."""
    log = StepLog(tmp_path, "ns", "job-worker-0")
    path = tmp_path / "kubelet-nodes/n1/kubelet/pod-logs/ns_job-worker-0_u1/trainer/0.log"
    path.parent.mkdir(parents=True)
    path.write_text("2026-12-05T10:20:51.49Z stderr F launcher started python\n"
                    "2026-12-05T10:20:53.91Z stdout F step 1 loss 0x1.0p+1\n"
                    "2026-12-05T10:20:54.11Z stdout F restored step 1 extra {}\n"
                    "2026-12-05T10:20:55.01Z stdout F step 2 loss 0x1.8p+0\n")
    assert [(s.step, s.loss, s.generation) for s in log.poll()] == [
        (1, "0x1.0p+1", 1), (2, "0x1.8p+0", 2)]
