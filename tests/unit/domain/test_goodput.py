"""The wasted-time model and the paper's effective-training-time simulation."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini.domain.goodput import (
    GEMINI,
    HIGHFREQ,
    PAPER_STRATEGIES,
    STRAWMAN,
    StrategyModel,
    effective_training_ratio,
    model_from_measurements,
    simulate,
    wasted_seconds_per_failure,
)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        pytest.param(GEMINI, 0.91, id="GEMINI keeps about 91% at 1000 instances"),
        pytest.param(HIGHFREQ, 0.59, id="HighFreq keeps about 59% at 1000 instances"),
        pytest.param(STRAWMAN, 0.0, id="Strawman keeps about nothing at 1000 instances"),
    ],
)
def test_paper_simulation_at_1000_instances(model: StrategyModel, expected: float) -> None:
    assert effective_training_ratio(model, 1000, 0.015) == pytest.approx(expected, abs=0.006)


@pytest.mark.parametrize(
    ("args", "minutes"),
    [
        pytest.param((62, 62, 3, 62), 1.6, id="GEMINI: about one and a half iterations of 62 s"),
        pytest.param((480, 9 * 62, 480, 62), 20.65, id="HighFreq: every 9 iterations to storage"),
        pytest.param((0, 3 * 3600, 0, 62), 90.0, id="Strawman: half of a three-hour interval"),
        pytest.param(
            (10, 1, 0, 5), 15 / 60, id="an interval shorter than a checkpoint is raised to it"
        ),
    ],
)
def test_wasted_time_per_failure(args: tuple[Any, ...], minutes: float) -> None:
    assert wasted_seconds_per_failure(*args) / 60 == pytest.approx(minutes, abs=0.01)


def test_measured_models_add_recovery_to_wasted_time() -> None:
    model = model_from_measurements(
        "ours", checkpoint_seconds=2, interval_seconds=10, retrieve_seconds=3, recovery_seconds=50
    )
    assert model.overhead_minutes_per_failure == pytest.approx(1.0)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: StrategyModel("x", -1.0), id="a negative overhead"),
        pytest.param(lambda: StrategyModel("x", 1.0, 1.5), id="a steady ratio above one"),
        pytest.param(lambda: wasted_seconds_per_failure(-1, 1, 1), id="a negative time"),
        pytest.param(lambda: effective_training_ratio(GEMINI, -5), id="negative instances"),
    ],
)
def test_nonsense_inputs_raise(make) -> None:
    with pytest.raises(ValueError):
        make()


def test_simulate_tabulates_every_strategy() -> None:
    rows = simulate([0, 1000])
    assert rows[0] == {"instances": 0.0, "gemini": 1.0, "highfreq": 480 / 560, "strawman": 1.0}
    assert set(rows[1]) == {"instances"} | {s.name for s in PAPER_STRATEGIES}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5000), rate=st.floats(0.0, 0.1))
def test_ratios_fall_with_cluster_size_and_gemini_leads(n: int, rate: float) -> None:
    for model in PAPER_STRATEGIES:
        now, later = (effective_training_ratio(model, x, rate) for x in (n, n + 100))
        assert 0.0 <= later <= now <= 1.0
    assert effective_training_ratio(GEMINI, n, rate) >= effective_training_ratio(STRAWMAN, n, rate)
