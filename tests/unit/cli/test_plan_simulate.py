"""`gemini plan` and `gemini simulate`: JSON keys, readable tables, errors, the plot."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gemini_cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--output", "json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(
            ["--nodes", "16", "--replicas", "2", "--failures", "3"],
            0.8,
            id="the paper's 16 machines in pairs survive three failures 80% of the time",
        ),
        pytest.param(
            ["--nodes", "16", "--replicas", "2", "--failures", "2"],
            14 / 15,
            id="and two failures 93.3% of the time",
        ),
        pytest.param(
            ["--nodes", "5", "--replicas", "1", "--failures", "1"],
            0.0,
            id="without peer copies a machine failure loses memory",
        ),
    ],
)
def test_plan_reports_the_recovery_probability(capsys, argv: list[Any], expected: float) -> None:
    report = run_json(capsys, "plan", *argv)
    assert report["recovery_probability"] == pytest.approx(expected)


def test_plan_lists_groups_and_what_each_machine_sends(capsys) -> None:
    report = run_json(capsys, "plan", "--nodes", "5", "--replicas", "2")
    assert report["groups"] == [[0, 1], [2, 3, 4]]
    assert report["sends"]["4"] == [2]
    assert report["failures"] == 2


def test_plan_with_zones_compares_placements_under_domain_failures(capsys) -> None:
    report = run_json(
        capsys,
        "plan",
        "--nodes",
        "60",
        "--replicas",
        "2",
        "--zones",
        "3",
        "--racks",
        "6",
        "--trials",
        "200",
    )
    assert report["strategy"] == "domain-aware"
    zone = report["domains"]["zone_failure"]
    assert zone["domain_aware"]["probability"] == 1.0
    assert zone["mixed"]["probability"] == 0.0
    assert report["domains"]["spread"]["mixed"]["rack"] == 2


def test_plan_prints_a_readable_table_by_default(capsys) -> None:
    assert main(["plan", "--nodes", "50", "--replicas", "2", "--zones", "2", "--racks", "4"]) == 0
    out = capsys.readouterr().out
    assert "recovery probability, 2 random failures" in out
    assert "one zone lost" in out and "GROUP" in out
    assert "5 more groups" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--nodes", "2", "--replicas", "3"],
            "at least 3 machines",
            id="more replicas than nodes",
        ),
        pytest.param(
            ["--nodes", "4", "--replicas", "2", "--failures", "5"],
            "--failures",
            id="more failures than nodes",
        ),
        pytest.param(
            ["--nodes", "4", "--replicas", "2", "--zones", "3", "--racks", "2"],
            "zones <= racks",
            id="fewer racks than zones",
        ),
    ],
)
def test_plan_errors_say_what_to_fix(capsys, argv: list[Any], message: str) -> None:
    assert main(["plan", *argv]) == 1
    assert message in capsys.readouterr().err


def test_simulate_matches_the_papers_simulation(capsys) -> None:
    report = run_json(capsys, "simulate", "--instances", "1000")
    assert report["gemini"] == pytest.approx(0.91, abs=0.006)
    assert report["highfreq"] == pytest.approx(0.59, abs=0.006)
    assert report["strawman"] == pytest.approx(0.0, abs=0.006)


def test_simulate_takes_our_measured_recovery_time(capsys) -> None:
    report = run_json(
        capsys,
        "simulate",
        "--instances",
        "100",
        "--failures-per-instance-day",
        "0.03",
        "--measured-recovery-seconds",
        "100",
        "--iteration-seconds",
        "10",
        "--retrieve-seconds",
        "5",
    )
    # (10 + 5 + 5 + 100) s = 2 minutes per failure, 3 failures a day.
    assert report["measured"] == pytest.approx(1 - 2 * 3 / 1440)


def test_simulate_prints_a_table_and_draws_a_plot(capsys, tmp_path) -> None:
    target = tmp_path / "curve.png"
    assert main(["simulate", "--instances", "300", "--plot", str(target)]) == 0
    out = capsys.readouterr().out
    assert "gemini" in out and "EFFECTIVE TRAINING TIME" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_rejects_an_empty_cluster(capsys) -> None:
    assert main(["simulate", "--instances", "0"]) == 1
    assert "--instances" in capsys.readouterr().err
