"""Median downtime per failure kind: `gemini demo --output json` run several times.

Downtime is from the fault's injection to the first training step printed by a restarted
trainer (the demo measures it from the trainer's own output), with the breakdown the operator
reports. Targets (issue 17): trainer crash <= 4 s, node loss <= 10 s, whole group restored from
S3 <= 12 s; each also as a ratio to the iteration time. The final line is one JSON object; its
value is the worst median's share of its target (<= 1: every target met).

    .venv/bin/python bench/recovery_downtime.py [--runs 3] [--workers 4] [--replicas 2]

Ctrl-C or SIGTERM (a timeout) stops it cleanly: the signal is passed on to the demo, which
tears down its cluster, operator and S3; the bench then makes sure (`gemini local down` on
the run's state directory, and no process naming it left) and exits with 130 or 143.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any

from support.cleanup import Cleanup, cleaning_up
from support.demo_runs import demo_report

from gemini_local.controlplane import NODE_GRACE_ENV

TARGETS = {"trainer-crash": 4.0, "node-loss": 10.0, "group-loss": 12.0}


def one_run(args: argparse.Namespace, cleanup: Cleanup) -> dict[str, Any]:
    extra = {NODE_GRACE_ENV: str(args.node_grace)} if args.node_grace is not None else {}
    return demo_report(
        ["--workers", str(args.workers), "--replicas", str(args.replicas), "--procs-per-node",
         str(args.procs_per_node), "--failures", args.failures,
         "--warm-standby" if args.warm_standby else "--no-warm-standby"],
        cleanup, args.tmp_dir, extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--procs-per-node", type=int, default=1,
                        help="training processes per worker pod (numProcPerNode)")
    parser.add_argument("--failures", default="trainer-crash,node-loss,group-loss")
    parser.add_argument("--node-grace", type=int, default=None,
                        help="the controller manager's --node-monitor-grace-period in seconds "
                        "(default 8; 40 is Kubernetes' own)")
    parser.add_argument("--warm-standby", action=argparse.BooleanOptionalAction, default=True,
                        help="the launchers' warm standby (on by default, as in a GeminiJob); "
                        "--no-warm-standby measures a crash whose replacement imports torch")
    parser.add_argument("--tmp-dir", default="/tmp",
                        help="where each run's state directory (gbench-*) is made")
    args = parser.parse_args()
    with cleaning_up() as cleanup:
        measure(args, cleanup)


def measure(args: argparse.Namespace, cleanup: Cleanup) -> None:
    downtimes: dict[str, list[float]] = defaultdict(list)
    breakdowns: dict[str, list[dict[str, float]]] = defaultdict(list)
    lost: dict[str, list[int]] = defaultdict(list)
    iterations = []
    for run in range(args.runs):
        report = one_run(args, cleanup)
        iterations.append(report["iteration_seconds"])
        for row in report["failures"]:
            if row["downtime_seconds"] is None:
                raise SystemExit(f"run {run}: {row['kind']} was not recovered: {row}")
            downtimes[row["kind"]].append(row["downtime_seconds"])
            breakdowns[row["kind"]].append(row["breakdown_seconds"])
            lost[row["kind"]].append(row["steps_lost"] or 0)
        print(f"run {run}: " + ", ".join(
            f"{r['kind']} {r['downtime_seconds']:.1f}s via {r['source'] or '?'} "
            f"(lost {r['steps_lost']}, match {r['losses_match']})" for r in report["failures"]),
            flush=True)
    medians = {kind: statistics.median(values) for kind, values in downtimes.items()}
    parts = {kind: {key: round(statistics.median(b.get(key, 0.0) for b in rows), 2)
                    for key in sorted({k for b in rows for k in b})}
             for kind, rows in breakdowns.items()}
    for kind, value in medians.items():
        print(f"{kind}: median downtime {value:.1f} s (target {TARGETS.get(kind, '-')}), "
              f"breakdown {parts[kind]}, steps lost {lost[kind]}")
    shares = [medians[k] / t for k, t in TARGETS.items() if k in medians]
    print(json.dumps({
        "metric": "recovery_downtime_median_vs_target",
        "value": round(max(shares), 3) if shares else None,
        "target": 1.0, "better": "lower", "unit": "ratio",
        "median_downtime_seconds": {k: round(v, 2) for k, v in medians.items()},
        "targets_seconds": TARGETS,
        "breakdown_seconds": parts,
        "iteration_seconds": round(statistics.median(iterations), 3),
        "downtime_in_iterations": {k: round(v / statistics.median(iterations), 1)
                                   for k, v in medians.items()},
        "runs": args.runs,
    }))


if __name__ == "__main__":
    main()
