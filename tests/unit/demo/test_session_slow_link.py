"""The demo's slow link: healed after its steps, reported without downtime or recovery."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gemini_demo import plan, session
from gemini_demo.logs import StepLine
from gemini_demo.plan import DemoConfig


@pytest.fixture
def demo(tmp_path: Path) -> session.Demo:
    options = session.DemoOptions(DemoConfig(failures=("slow-link",)), tmp_path,
                                  progress=io.StringIO())
    return session.Demo(options)


def steps(demo: session.Demo, first: int, last: int, start: float, gap: float) -> None:
    demo.log.lines += [StepLine(start + gap * (s - first), s, f"0x{s}p+0", 1)
                       for s in range(first, last + 1)]


def test_the_slowed_node_is_healed_once_training_made_its_steps(
    demo: session.Demo, monkeypatch: pytest.MonkeyPatch,
) -> None:
    healed: list[str] = []

    def heal(_state_dir: Path, node: str, missing_ok: bool = True) -> bool:
        healed.append(node)
        return True

    monkeypatch.setattr("gemini_demo.session.faults.heal_node", heal)
    item = session.Injected("slow-link", "node-3", at=10.0, generation=1, step_at=7)
    steps(demo, 8, 7 + plan.SLOW_LINK_STEPS - 1, 10.5, 1.0)
    assert not demo.heal_slow_link(item) and healed == []
    steps(demo, 7 + plan.SLOW_LINK_STEPS, 7 + plan.SLOW_LINK_STEPS, 30.0, 1.0)
    assert demo.heal_slow_link(item) and healed == ["node-3"]
    assert item.healed_at is not None


def test_its_report_row_has_no_downtime_and_the_slowed_steps(demo: session.Demo) -> None:
    steps(demo, 1, 7, 0.0, 0.5)  # before: 0.5 s a step
    steps(demo, 8, 15, 10.0, 1.5)  # slowed: 1.5 s a step
    item = session.Injected("slow-link", "node-3", at=9.9, generation=1, step_at=7,
                            healed_at=21.0)
    record = demo.record(item)
    assert (record.downtime_seconds, record.steps_lost, record.detected_at) == (0.0, None, None)
    assert record.last_step_before == 7
    reference = {line.step: line.loss for line in demo.log.lines}
    assert demo.matches_after(item, float("inf"), reference)
    assert not demo.matches_after(item, float("inf"), {**reference, 9: "0x0p+0"})
    summary = demo.slow_link_summary(item)
    assert summary == {"rate_bytes_per_second": plan.SLOW_LINK_RATE, "slowed_seconds": 11.1,
                       "steps_slowed": 8, "iteration_seconds_slowed": 1.5}
