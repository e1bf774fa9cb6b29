"""Follow one rank's trainer output on the local nodes, across restarts and replacement pods.

The node agents append each container run's output to
`<state>/nodes/<node>/pods/<ns>_<pod>_<uid>/logs/<container>/<run>.log`, real kubelets to
`<state>/kubelet-nodes/<node>/kubelet/pod-logs/<ns>_<pod>_<uid>/<container>/<restart>.log`. Reading
the files (not the API) keeps the lines of pods that are gone, and timestamps each line when
first seen, which is what downtime is measured with.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gemini_demo.report import rank0_loss
from gemini_local.cluster import KUBELET_NODES
from gemini_local.kubelet.node import POD_LOGS

_RESTORED = re.compile(r"^(?:\[rank0\]: )?restored step (\d+)")
# A real kubelet writes each container's output under its node's podLogsDir, each line
# prefixed with its time, stream and tag (the CRI log format).
KUBELET_LOGS = f"{KUBELET_NODES}/*/{POD_LOGS}"
_CRI_PREFIX = re.compile(r"^\S+ (?:stdout|stderr) [FP] ")


@dataclass(frozen=True)
class StepLine:
    seen_at: float  # seconds since the demo started
    step: int
    loss: str  # float hex
    generation: int  # grows with each new process (a new file or a "restored" line)


@dataclass
class StepLog:
    """Incremental reader of `<pod-glob>/logs/<container>/*.log` under the state dir."""

    state_dir: Path
    namespace: str
    pod: str
    container: str = "trainer"
    clock: Callable[[], float] = time.monotonic
    started: float = 0.0
    lines: list[StepLine] = field(default_factory=list)
    restored: list[tuple[float, int]] = field(default_factory=list)  # (seen_at, step)
    _offsets: dict[Path, int] = field(default_factory=dict)
    _partial: dict[Path, str] = field(default_factory=dict)
    generation: int = 0

    def files(self) -> list[Path]:
        pod = f"{self.namespace}_{self.pod}_*"
        found = [*self.state_dir.glob(f"nodes/*/pods/{pod}/logs/{self.container}/*.log"),
                 *self.state_dir.glob(f"{KUBELET_LOGS}/{pod}/{self.container}/*.log")]
        return sorted(found, key=lambda p: (p.stat().st_mtime if p.exists() else 0.0, str(p)))

    def poll(self) -> list[StepLine]:
        """Read what was appended since the last call; return the new step lines."""
        new: list[StepLine] = []
        now = self.clock() - self.started
        for path in self.files():
            if path not in self._offsets:
                self._offsets[path] = 0
                self.generation += 1
            try:
                with open(path, "rb") as handle:
                    handle.seek(self._offsets[path])
                    chunk = handle.read()
            except OSError:
                continue
            self._offsets[path] += len(chunk)
            text = self._partial.pop(path, "") + chunk.decode(errors="replace")
            *complete, rest = text.split("\n")
            if rest:
                self._partial[path] = rest
            for raw in complete:
                new += self._line(raw, now)
        self.lines += new
        return new

    def _line(self, raw: str, now: float) -> list[StepLine]:
        line = _CRI_PREFIX.sub("", raw, count=1).strip()
        if restored := _RESTORED.match(line):
            self.generation += 1
            self.restored.append((now, int(restored.group(1))))
            return []
        found = rank0_loss(line)
        if found is None:
            return []
        return [StepLine(now, found[0], found[1], self.generation)]

    def restored_after(self, at: float) -> int | None:
        """The step of the first "restored step N" line seen at or after `at`: what the
        trainer itself says it restored."""
        return next((step for seen_at, step in self.restored if seen_at >= at), None)

    def last(self) -> StepLine | None:
        return self.lines[-1] if self.lines else None

    def losses(self) -> list[tuple[int, str]]:
        return [(line.step, line.loss) for line in self.lines]

    def timeline(self) -> list[tuple[float, int, str]]:
        return [(line.seen_at, line.step, line.loss) for line in self.lines]


def resumption(lines: list[StepLine], injected_at: float,
               generation_at_injection: int) -> tuple[StepLine, int] | None:
    """The first step of a process started after the failure, and the newest step printed
    before it; None while training has not resumed. A replayed step (one not above the
    newest before it) also counts: an in-place restart writes to the same file, and a run
    restored from nothing prints no "restored" line."""
    newest = 0
    for line in lines:
        after = line.seen_at >= injected_at
        if after and (line.generation > generation_at_injection or line.step <= newest):
            return line, newest
        newest = max(newest, line.step)
    return None
