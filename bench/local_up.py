"""Benchmark: `gemini local up` with cached binaries and 4 nodes, healthy within 20 s (node
agents), or with `--kubelet` 4 real kubelet nodes (containerd, runc) Ready within 30 s.

The baseline measured in the same run is the bare control plane (etcd, API server, KCM,
scheduler) without nodes: the ratio says what the nodes add on top of it.
Prints medians of several runs; the last line is the JSON result.
Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from support.cleanup import Cleanup, cleaning_up

from gemini_local import cluster, controlplane
from gemini_local.kubelet.node import pause_binary

RUNS = 3
TARGET_SECONDS = {False: 20.0, True: 30.0}  # node agents, kubelet nodes


def time_cluster_up(cleanup: Cleanup, nodes: int, kubelet: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-up-") as tmp:
        state = cleanup.cluster(Path(tmp))
        try:
            started = time.monotonic()
            cluster.up(state, cluster.Topology(nodes=nodes, zones=2, racks=2), kubelet=kubelet)
            elapsed = time.monotonic() - started
        finally:
            cluster.down(state)
    return elapsed


def time_control_plane_only(cleanup: Cleanup) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        state = cleanup.cluster(Path(tmp))
        try:
            started = time.monotonic()
            controlplane.start_control_plane(state)
            elapsed = time.monotonic() - started
        finally:
            controlplane.stop_control_plane(state)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubelet", action="store_true", help="real kubelet nodes (root)")
    kubelet = parser.parse_args().kubelet
    controlplane.binaries_dir()  # build outside the timed region if missing
    if kubelet:
        pause_binary()
    with cleaning_up() as cleanup:
        bare = [time_control_plane_only(cleanup) for _ in range(RUNS)]
        full = [time_cluster_up(cleanup, 4, kubelet) for _ in range(RUNS)]
    print(f"control plane alone: {[round(x, 2) for x in bare]} s, median "
          f"{statistics.median(bare):.2f} s")
    kind = "kubelet nodes" if kubelet else "nodes"
    print(f"local up, 4 {kind}: {[round(x, 2) for x in full]} s, median "
          f"{statistics.median(full):.2f} s "
          f"({statistics.median(full) / statistics.median(bare):.2f}x the bare control plane)")
    print(json.dumps({
        "metric": f"local_up_4_{'kubelet_' if kubelet else ''}nodes_healthy_seconds",
        "value": round(statistics.median(full), 2),
        "target": TARGET_SECONDS[kubelet], "better": "lower", "unit": "s",
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
