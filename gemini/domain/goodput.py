"""Wasted time per failure and the effective-training-time model of the paper.

Per failure, a job loses the work since its last complete checkpoint and the time to recover:
T_wasted = t_ckpt + 1/(2f) + t_retrieve, where 1/f is the checkpoint interval and cannot be
shorter than one checkpoint or one iteration. Over a day with F failures, a strategy whose
per-failure overhead is O minutes keeps a fraction steady - O * F / 1440 of its time for
training (steady < 1 when checkpoints themselves stall training, as HighFreq's do).

The paper's constants are the presets below; `model_from_measurements` builds a model from
our own measured checkpoint, retrieval and recovery times instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MINUTES_PER_DAY = 1440.0
# OPT-175B logs: about 1.5% of instances fail per day.
PAPER_FAILURES_PER_INSTANCE_DAY = 0.015


@dataclass(frozen=True)
class StrategyModel:
    """A checkpointing strategy as the simulation sees it."""

    name: str
    overhead_minutes_per_failure: float  # wasted work + recovery, per failure
    steady_ratio: float = 1.0  # share of time spent training when nothing fails

    def __post_init__(self) -> None:
        if self.overhead_minutes_per_failure < 0 or not 0 <= self.steady_ratio <= 1:
            raise ValueError(
                f"{self.name}: need overhead >= 0 and 0 <= steady_ratio <= 1, got "
                f"{self.overhead_minutes_per_failure}, {self.steady_ratio}"
            )


# The paper's simulation inputs: per-failure overheads in minutes; HighFreq's checkpoints to
# remote storage also slow training when nothing fails, to the paper's stated 480/560.
GEMINI = StrategyModel("gemini", 9.0)
HIGHFREQ = StrategyModel("highfreq", 26.0, 480.0 / 560.0)
STRAWMAN = StrategyModel("strawman", 112.0)
PAPER_STRATEGIES = (GEMINI, HIGHFREQ, STRAWMAN)


def wasted_seconds_per_failure(
    checkpoint_seconds: float,
    interval_seconds: float,
    retrieve_seconds: float,
    iteration_seconds: float = 0.0,
) -> float:
    """T_wasted = t_ckpt + 1/(2f) + t_retrieve, with the interval 1/f raised to at least
    max(t_ckpt, T_iter): a checkpoint cannot start before the previous one finished, nor more
    often than once per iteration."""
    if min(checkpoint_seconds, interval_seconds, retrieve_seconds, iteration_seconds) < 0:
        raise ValueError("times must be non-negative")
    interval = max(interval_seconds, checkpoint_seconds, iteration_seconds)
    return checkpoint_seconds + interval / 2 + retrieve_seconds


def model_from_measurements(
    name: str,
    *,
    checkpoint_seconds: float,
    interval_seconds: float,
    retrieve_seconds: float,
    recovery_seconds: float,
    iteration_seconds: float = 0.0,
    steady_ratio: float = 1.0,
) -> StrategyModel:
    """A strategy from measured times: overhead = T_wasted + the rest of the recovery
    (detection, replacement, restart), all in seconds."""
    if recovery_seconds < 0:
        raise ValueError("recovery_seconds must be non-negative")
    wasted = wasted_seconds_per_failure(
        checkpoint_seconds, interval_seconds, retrieve_seconds, iteration_seconds
    )
    return StrategyModel(name, (wasted + recovery_seconds) / 60.0, steady_ratio)


def failures_per_day(instances: int, failures_per_instance_day: float) -> float:
    if instances < 0 or failures_per_instance_day < 0:
        raise ValueError("instances and the failure rate must be non-negative")
    return instances * failures_per_instance_day


def effective_training_ratio(
    model: StrategyModel,
    instances: int,
    failures_per_instance_day: float = PAPER_FAILURES_PER_INSTANCE_DAY,
) -> float:
    """Share of wall time spent on useful training (0 once failures eat the whole day)."""
    lost = model.overhead_minutes_per_failure * failures_per_day(
        instances, failures_per_instance_day
    )
    return max(0.0, model.steady_ratio - lost / MINUTES_PER_DAY)


def simulate(
    instances: Iterable[int],
    failures_per_instance_day: float = PAPER_FAILURES_PER_INSTANCE_DAY,
    strategies: Sequence[StrategyModel] = PAPER_STRATEGIES,
) -> list[dict[str, float]]:
    """One row per cluster size: {"instances": n, "<strategy>": ratio, ...}."""
    return [
        {"instances": float(n)}
        | {s.name: effective_training_ratio(s, n, failures_per_instance_day) for s in strategies}
        for n in instances
    ]
