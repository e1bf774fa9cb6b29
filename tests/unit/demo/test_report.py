"""The demo report: loss comparison and per-failure arithmetic."""

from __future__ import annotations

import pytest

from gemini_demo.report import (
    FailureRecord,
    failure_row,
    losses_match,
    parse_losses,
    plot,
    render_text,
)

REFERENCE = {1: (2.5).hex(), 2: (2.25).hex(), 3: (2.0).hex()}


def test_loss_lines_are_parsed_in_order_including_replayed_steps() -> None:
    lines = ["noise", f"step 1 loss {REFERENCE[1]}", f"step 2 loss {REFERENCE[2]}",
             f"step 2 loss {REFERENCE[2]}", "step x loss y"]
    assert parse_losses(lines) == [(1, REFERENCE[1]), (2, REFERENCE[2]), (2, REFERENCE[2])]


@pytest.mark.parametrize(
    ("case", "run", "expected"),
    [
        ("identical run with a replayed step matches", [(1, REFERENCE[1]), (2, REFERENCE[2]),
                                                         (2, REFERENCE[2]), (3, REFERENCE[3])],
         True),
        ("one bit of difference in a replayed step does not match",
         [(1, REFERENCE[1]), (2, REFERENCE[2]), (2, (2.25 + 2**-50).hex()), (3, REFERENCE[3])],
         False),
        ("a run that stopped early does not match", [(1, REFERENCE[1])], False),
        ("an empty run does not match", [], False),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_losses_match(case: str, run: list[tuple[int, str]], expected: bool) -> None:
    assert losses_match(run, REFERENCE) is expected


def test_a_failure_row_counts_downtime_and_steps_lost() -> None:
    record = FailureRecord(kind="node-loss", target="node-1", injected_at=10.0,
                           detected_at=10.5, resumed_at=22.0, source="peer",
                           last_step_before=7, resumed_from_step=7,
                           breakdown={"detect": 0.5, "replace": 3.0})
    row = failure_row(record, True, iteration_seconds=2.0, s3_checkpoint_seconds=8.0,
                      s3_restore_seconds=4.0)
    assert row["downtime_seconds"] == 12.0
    assert row["detection_seconds"] == 0.5
    assert row["steps_lost"] == 1
    assert row["wasted_seconds"] == 14.0
    assert row["model_wasted_seconds_gemini"] == 2.0 + 1.0 + 12.0
    assert row["model_wasted_seconds_s3_only"] == 8.0 + 4.0 + 4.0 + 12.0


def test_the_plot_is_written(tmp_path) -> None:
    out = tmp_path / "loss.png"
    plot(str(out), [(1.0, 1, REFERENCE[1]), (2.0, 2, REFERENCE[2])], REFERENCE,
         [{"kind": "trainer-crash", "injected_at_seconds": 1.5, "downtime_seconds": 0.4,
           "source": "local", "step_at_failure": 1}])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_s3_timings_the_baseline_is_absent_and_the_text_says_so() -> None:
    record = FailureRecord(kind="trainer-crash", target="gpt-demo-worker-1", injected_at=5.0,
                           detected_at=None, resumed_at=None, source="", last_step_before=4,
                           resumed_from_step=None)
    row = failure_row(record, False, iteration_seconds=0.5, s3_checkpoint_seconds=None,
                      s3_restore_seconds=None)
    assert row["model_wasted_seconds_s3_only"] is None
    assert row["downtime_seconds"] is None and row["steps_lost"] is None
    text = render_text({"iteration_seconds": 0.5, "steps": 20, "losses_match": False,
                        "failures": [row]})
    assert "losses equal the reference: NO" in text
    (line,) = [t for t in text.splitlines() if t.startswith("trainer-crash")]
    assert line.split() == ["trainer-crash", "?", "-", "-", "-", "NO", "-", "-"]
    extra = {"epoch": 5, "source": "local", "message": "rank 1: exited with code 1"}
    text = render_text({"iteration_seconds": 0.5, "steps": 20, "losses_match": True,
                        "failures": [row], "unplanned_recoveries": [extra]})
    assert text.splitlines()[-1] == ("also recovered (no failure injected): epoch 5, from "
                                     "local: rank 1: exited with code 1")
