"""The paper's headline, end to end: wasted time per node loss recovering from CPU memory
(m = 2) against S3 only (m = 1, uploading back to back: the paper's "HighFreq" baseline).

The same job both ways: 4 workers on the local cluster, the demo's GPT at its "headline" size
(DeepSpeed ZeRO-3, 271 MB of checkpoint per rank: fp32 weights and Adam's two moments), an
in-memory checkpoint every iteration. Each run is one `gemini demo --failures node-loss`:

    wasted = downtime (the fault to the first step printed after it, from the trainer's own
             output) + lost progress (the steps done again x the iteration time)

Memory mode keeps the demo's S3 persistence (every 30 s); S3-only mode has one in-memory copy
(the lost node's shard survives only in S3) and `persistence.intervalSeconds: 1`, so a new
upload starts as soon as the last one ends. The modes alternate, so the machine's noise hits
both alike; medians of --runs each. A run whose recovery came from the wrong tier, or whose
losses differ from the uninterrupted reference, fails the bench.

    .venv/bin/python bench/headline.py [--runs 3] [--steps 16]

Target (issue 17): S3-only / memory >= 13 (the paper reports more than 13 times faster
recovery). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from support.cleanup import Cleanup, cleaning_up
from support.demo_runs import demo_report

TARGET = 13.0
MODES = {
    # mode: (demo options, the tier the node's shards must come back from)
    "memory": (["--replicas", "2"], "peer"),
    "s3_only": (["--replicas", "1", "--persist-interval", "1"], "s3"),
}


def one_run(mode: str, args: argparse.Namespace, cleanup: Cleanup) -> dict[str, Any]:
    options, source = MODES[mode]
    report = demo_report(
        ["--workers", "4", "--model-size", "headline", "--failures", "node-loss", "--steps",
         str(args.steps), "--step-sleep", "0", *options], cleanup, args.tmp_dir)
    row = next(r for r in report["failures"] if r["kind"] == "node-loss")
    if row["wasted_seconds"] is None:
        raise SystemExit(f"{mode}: the node loss was not recovered: {row}")
    if row["source"] != source or not row["losses_match"]:
        raise SystemExit(f"{mode}: restored from {row['source'] or '?'} (expected {source}), "
                         f"losses match the reference: {row['losses_match']}: {row}")
    return {"wasted_seconds": row["wasted_seconds"], "downtime_seconds": row["downtime_seconds"],
            "steps_lost": row["steps_lost"], "iteration_seconds": report["iteration_seconds"],
            "breakdown_seconds": row["breakdown_seconds"],
            "s3_checkpoint": report.get("s3_checkpoint")}


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 2)


def measure(args: argparse.Namespace, cleanup: Cleanup) -> None:
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for index in range(args.runs):
        for mode in MODES:
            result = one_run(mode, args, cleanup)
            runs[mode].append(result)
            print(f"run {index} {mode}: wasted {result['wasted_seconds']:.1f} s = downtime "
                  f"{result['downtime_seconds']:.1f} s + {result['steps_lost']} steps lost x "
                  f"{result['iteration_seconds']:.2f} s", flush=True)
    summary = {mode: {key: median_of(rows, key) for key in
                      ("wasted_seconds", "downtime_seconds", "steps_lost", "iteration_seconds")}
               for mode, rows in runs.items()}
    for mode, figures in summary.items():
        print(f"{mode}: medians {figures}", flush=True)
    ratio = summary["s3_only"]["wasted_seconds"] / summary["memory"]["wasted_seconds"]
    print(json.dumps({
        "metric": "headline_wasted_time_s3_only_over_memory",
        "value": round(ratio, 2), "target": TARGET, "better": "higher", "unit": "ratio",
        "medians": summary, "runs": runs, "workers": 4, "model_size": "headline",
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode (default 3)")
    parser.add_argument("--steps", type=int, default=16,
                        help="training steps of each run (default 16)")
    parser.add_argument("--tmp-dir", default="/tmp",
                        help="where each run's state directory (gbench-*) is made")
    args = parser.parse_args()
    with cleaning_up() as cleanup:
        measure(args, cleanup)


if __name__ == "__main__":
    main()
