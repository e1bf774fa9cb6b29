"""The demo's report: per failure what happened and what it cost, losses against a reference.

Pure: parsed training output and timestamps in, a JSON-ready dict and text out. Times are
seconds since the demo started, passed in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gemini.domain.goodput import wasted_seconds_per_failure

# With several processes per node the launcher prefixes each line with its rank.
_LOSS_LINE = re.compile(r"^(?:\[rank(\d+)\]: )?step (\d+) loss (\S+)\s*$")


def rank0_loss(line: str) -> tuple[int, str] | None:
    """(step, loss) of a `step <n> loss <float hex>` line of rank 0 (or unprefixed)."""
    match = _LOSS_LINE.match(line.strip())
    if not match or match.group(1) not in (None, "0"):
        return None
    return int(match.group(2)), match.group(3)


def parse_losses(lines: Iterable[str]) -> list[tuple[int, str]]:
    """Every rank 0 `step <n> loss <float hex>` line, in order (a replayed step appears
    again)."""
    return [found for line in lines if (found := rank0_loss(line)) is not None]


def losses_match(run: Sequence[tuple[int, str]], reference: Mapping[int, str]) -> bool:
    """True when every loss the run printed, replays included, equals the reference bit for
    bit (float hex), and the run covered every reference step."""
    if not run:
        return False
    same = all(reference.get(step) == loss for step, loss in run)
    return same and set(reference) <= {step for step, _ in run}


def float_of(hex_loss: str) -> float:
    return float.fromhex(hex_loss)


@dataclass(frozen=True)
class FailureRecord:
    """One injected failure as the demo saw it (seconds since the demo started)."""

    kind: str  # trainer-crash | node-loss | group-loss | ...
    target: str  # the pod or node(s) hit
    injected_at: float
    detected_at: float | None  # the operator's Recovering condition appeared
    resumed_at: float | None  # training printed a new step after the failure
    source: str  # local | peer | s3 | "" when unknown
    last_step_before: int  # the newest step printed before the failure
    resumed_from_step: int | None  # the first step printed after it
    breakdown: Mapping[str, float] = field(default_factory=dict)
    restored_step: int | None = None  # the trainer's own "restored step N" line after it

    @property
    def downtime_seconds(self) -> float | None:
        return None if self.resumed_at is None else self.resumed_at - self.injected_at

    @property
    def steps_lost(self) -> int | None:
        """Steps that had been done and had to be done again."""
        if self.resumed_from_step is None:
            return None
        return max(0, self.last_step_before - self.resumed_from_step + 1)


def failure_row(
    record: FailureRecord, match: bool, iteration_seconds: float,
    s3_checkpoint_seconds: float | None, s3_restore_seconds: float | None,
) -> dict[str, Any]:
    """The JSON row of one failure, with the paper's wasted-time model beside the measurement.

    In-memory checkpoints every iteration waste about one and a half iterations plus the
    recovery; S3-only checkpointing at the highest rate S3 sustains (one checkpoint at a time)
    wastes its checkpoint time, half its interval and the S3 retrieval. Without S3 timings
    (nothing was persisted) that baseline is None.
    """
    downtime = record.downtime_seconds
    lost = record.steps_lost
    measured = None if downtime is None or lost is None else downtime + lost * iteration_seconds
    return {
        "kind": record.kind,
        "target": record.target,
        "source": record.source,
        "injected_at_seconds": round(record.injected_at, 2),
        "detection_seconds": _round(_minus(record.detected_at, record.injected_at)),
        "downtime_seconds": _round(downtime),
        "breakdown_seconds": {k: round(v, 2) for k, v in record.breakdown.items()},
        "steps_lost": lost,
        "step_at_failure": record.last_step_before,
        "resumed_at_step": record.resumed_from_step,
        "trainer_restored_step": record.restored_step,
        "losses_match": match,
        "wasted_seconds": _round(measured),
        # A checkpoint completes within the next iteration, so t_ckpt is about one iteration.
        "model_wasted_seconds_gemini": round(
            wasted_seconds_per_failure(
                iteration_seconds, iteration_seconds, 0.0, iteration_seconds)
            + (downtime or 0.0), 2),
        "model_wasted_seconds_s3_only": None
        if s3_checkpoint_seconds is None or s3_restore_seconds is None
        else round(
            wasted_seconds_per_failure(
                s3_checkpoint_seconds, s3_checkpoint_seconds, s3_restore_seconds,
                iteration_seconds)
            + (downtime or 0.0), 2),
    }


def _minus(a: float | None, b: float) -> float | None:
    return None if a is None else a - b


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def render_text(report: Mapping[str, Any]) -> str:
    """The report as a person reads it at the end of the demo."""
    lines = [
        f"iteration time {report['iteration_seconds']:.2f} s, "
        f"{report['steps']} steps, losses equal the reference: "
        f"{'yes' if report['losses_match'] else 'NO'}",
        "",
        f"{'failure':<14}{'source':<8}{'detect s':>9}{'down s':>8}{'lost':>6}"
        f"{'match':>7}{'wasted s':>10}{'S3-only s':>11}",
    ]
    for row in report["failures"]:
        lines.append(
            f"{row['kind']:<14}{row['source'] or '?':<8}{_fmt(row['detection_seconds']):>9}"
            f"{_fmt(row['downtime_seconds']):>8}{_fmt(row['steps_lost']):>6}"
            f"{'yes' if row['losses_match'] else 'NO':>7}{_fmt(row['wasted_seconds']):>10}"
            f"{_fmt(row['model_wasted_seconds_s3_only']):>11}"
        )
        if row["breakdown_seconds"]:
            parts = ", ".join(f"{k} {v:.1f}s" for k, v in row["breakdown_seconds"].items())
            lines.append(f"{'':<14}breakdown: {parts}")
    for extra in report.get("unplanned_recoveries") or []:
        lines.append(f"also recovered (no failure injected): epoch {extra['epoch']}, "
                     f"from {extra['source'] or '?'}: {extra['message']}")
    if monitoring := report.get("monitoring"):
        up = ", ".join(f"{job} {n}" for job, n in sorted(monitoring["targets_scraped"].items()))
        counted = ", ".join(f"{k} {v:g}" for k, v in sorted(monitoring["recoveries"].items()))
        lines += ["", f"Prometheus {monitoring['url']}: targets scraped: {up or 'none'}; "
                  f"recoveries it counted (cause/source): {counted or 'none'}; try "
                  f"{monitoring['url']}/api/v1/alerts (with --keep it stays up)"]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def plot(
    path: str, run: Sequence[tuple[float, int, str]], reference: Mapping[int, str],
    failures: Sequence[Mapping[str, Any]],
) -> None:
    """Loss against step (the run's printed points and the reference), failures marked with
    their downtime. `run` holds (seconds since start, step, loss hex)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_time) = plt.subplots(2, 1, figsize=(9, 7))
    ref_steps = sorted(reference)
    ax_step.plot(ref_steps, [float_of(reference[s]) for s in ref_steps], "k-", lw=1,
                 label="uninterrupted reference")
    ax_step.plot([s for _, s, _ in run], [float_of(v) for _, _, v in run], "o", ms=3,
                 label="run with failures (replayed steps included)")
    for row in failures:
        if row.get("step_at_failure"):
            ax_step.axvline(row["step_at_failure"] + 0.5, color="tab:red", ls="--", lw=1)
            ax_step.annotate(row["kind"], (row["step_at_failure"] + 0.5, 0.98),
                             xycoords=("data", "axes fraction"), fontsize=8, va="top",
                             rotation=90)
    ax_step.set(xlabel="step", ylabel="loss", title="Loss per step (failures dashed)")
    ax_step.legend()
    ax_time.plot([t for t, _, _ in run], [s for _, s, _ in run], ".", ms=3)
    for row in failures:
        start = row["injected_at_seconds"]
        down = row["downtime_seconds"] or 0.0
        ax_time.axvspan(start, start + down, color="tab:red", alpha=0.25)
        ax_time.annotate(f"{row['kind']}\n{down:.1f}s ({row['source']})", (start, 0.02),
                         xycoords=("data", "axes fraction"), fontsize=8, va="bottom")
    ax_time.set(xlabel="seconds since start", ylabel="step", title="Progress and downtime")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
