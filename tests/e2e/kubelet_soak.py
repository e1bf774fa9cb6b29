"""The soak on real kubelet nodes: one DeepSpeed job (examples image, 2 workers, m = 2) through
failures of random kinds, each injected once training runs again after the previous one.

Kinds: a killed training process (recovered in place from local memory), a lost node and a
partitioned node (a spare kubelet node added first; the worker is replaced and fetches its
shard from its peer; the partitioned node is healed once the job recovered, and its kubelet
ends the old pod's containers), a killed sidecar container (the kubelet restarts it; no
recovery, and it holds its peer's replica again at a later step) and a hung one (stopped
2-8 s, then resumed; likewise). Nothing leaks: after each failure every live node's containerd
runs containers of the job's pods only for their current incarnation, and once the job is
deleted no container of it runs and no volume of its pods is mounted. Rank 0's losses, read
from the kubelets' pod-log files of every incarnation (a lost node's stay on its disk), equal
an uninterrupted run's; a re-run step repeats its loss.

How many: GEMINI_KUBELET_SOAK_FAILURES (default 5: each kind once, what CI runs; `./dev soak`
runs 20); the order, targets and delays come from GEMINI_SOAK_SEED (printed) when set.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from gemini_demo.crash import kill_training_process
from gemini_demo.logs import StepLog
from gemini_local import faults, kubelet
from gemini_local.cluster import KUBELET_NODES
from gemini_operator.core import naming
from tests.e2e.kubelet_training import (
    MODEL,
    ensure_free_nodes,
    finished,
    held_replicas,
    newest_step,
    rank_of,
    recovery_after,
    resumed_at,
    trainer_log,
)
from tests.fixtures.nodes import wait_until

KINDS = ("trainer", "node", "partition", "sidecar", "sidecar-hang")
FAILURES = int(os.environ.get("GEMINI_KUBELET_SOAK_FAILURES") or len(KINDS))
# A failure used 2-9 steps at 1 s each (a spare node started, the random delay, the recovery,
# a step past the restored one); 12 leave a margin, and training goes on past the last one.
STEPS = 12 * FAILURES + 12
SOAK_MODEL = [*MODEL[:MODEL.index("--steps")], "--steps", str(STEPS),
              *MODEL[MODEL.index("--steps") + 2:]]
# (cause, source) of the recovery each kind must end in; None: none at all.
EXPECTED: dict[str, tuple[str, str] | None] = {
    "trainer": ("software", "Local"), "node": ("hardware", "Peers"),
    "partition": ("hardware", "Peers"), "sidecar": None, "sidecar-hang": None}
HANG_S = (2.0, 8.0)
NAMESPACE = "default"
_STORY = re.compile(r"(?:restored step \d+|step \d+ loss)")


def failure_kinds(rng: random.Random, count: int) -> list[str]:
    """`count` kinds in a random order, each of KINDS once as far as `count` allows."""
    kinds = [*KINDS[:count], *(rng.choice(KINDS) for _ in range(count - len(KINDS)))]
    rng.shuffle(kinds)
    return kinds


@dataclass
class KubeletSoak:
    state_dir: Path
    api: client.ApiClient
    operator_node: str
    name: str
    rng: random.Random
    epoch: int = 1
    uids: set[str] = field(default_factory=set)
    durations: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.rank0 = StepLog(self.state_dir, NAMESPACE, f"{self.name}-worker-0")
        self.files: dict[Path, list[str]] = {}  # rank 0's log files: the step lines each held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Rank 0's files are read every 0.5 s: a kubelet removes a deleted pod's logs.
        threading.Thread(target=self._follow, name="rank0-log", daemon=True).start()

    def _follow(self) -> None:
        while not self._stop.wait(0.5):
            self.read_losses()

    def stop(self) -> None:
        self._stop.set()

    def story(self) -> str:
        """Each rank 0 log file read: its node, pod uid and first and last step lines."""
        with self._lock:
            return "\n".join(f"{f.parts[-6]} {f.parts[-3][-36:]} {f.name}: {lines[:2]} .. "
                             f"{lines[-3:]}" for f, lines in self.files.items())

    # --- reads ---------------------------------------------------------------------------

    def pods(self) -> dict[str, Any]:
        """The job's worker pods that are not going away, by name."""
        found = self.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"{naming.LABEL_JOB}={self.name}").items
        live = {p.metadata.name: p for p in found if not p.metadata.deletion_timestamp}
        self.uids |= {p.metadata.uid for p in live.values()}
        return live

    def read_losses(self) -> None:
        """Take up rank 0's newest log lines; a re-run step must repeat its loss."""
        with self._lock:
            self.rank0.poll()
            for path in self.rank0.files():  # what each file held when last seen
                try:
                    text = path.read_text(errors="replace")
                except OSError:
                    continue
                self.files[path] = [m.group(0) for m in _STORY.finditer(text)]
            seen: dict[int, str] = {}
            for step, loss in self.rank0.losses():
                assert seen.setdefault(step, loss) == loss, \
                    f"step {step}: {seen[step]} then {loss}"

    def losses(self) -> dict[int, str]:
        self.read_losses()
        return dict(self.rank0.losses())

    def live_nodes(self) -> list[kubelet.KubeletNode]:
        return [n for n in kubelet.kubelet_nodes(self.state_dir / KUBELET_NODES)
                if n.running_pids()["containerd"] is not None]

    def assert_checks_see_the_job(self) -> None:
        """The leak checks find what they look for: each current pod's running containers
        and its memory volume's mount on its node."""
        nodes = {n.name: n for n in self.live_nodes()}
        for name, pod in self.pods().items():
            node = nodes[pod.spec.node_name]
            uid = pod.metadata.uid
            assert _containers(node, name, uid) & _running_tasks(node), f"{name}: no container"
            assert any(uid in m for m in kubelet.mounts_under(node.state_dir)), \
                f"{name}: no volume mounted under {node.state_dir}"

    def stray_containers(self) -> list[str]:
        """Running containers on live nodes of the job's pods other than their current
        incarnations (the pod on that node with that uid)."""
        current = {(p.spec.node_name, name, p.metadata.uid) for name, p in self.pods().items()}
        stray = []
        for node in self.live_nodes():
            running = _running_tasks(node)
            for pod in (f"{self.name}-worker-{r}" for r in range(2)):
                mine = {uid for n, name, uid in current if n == node.name and name == pod}
                tasks = _containers(node, pod) & running
                kept = set().union(*(_containers(node, pod, uid) for uid in mine))
                stray += [f"{node.name}: {pod} container {t[:12]}" for t in tasks - kept]
        return stray

    # --- failures --------------------------------------------------------------------------

    def run(self, kinds: list[str]) -> None:
        for number, kind in enumerate(kinds, 1):
            self.wait_training()
            time.sleep(self.rng.uniform(0, 2))
            started = time.monotonic()
            target = getattr(self, "_" + kind.replace("-", "_"))()
            self.durations.append((kind, round(time.monotonic() - started, 1)))
            print(f"kubelet soak {number}/{len(kinds)}: {kind} of {target} done in "
                  f"{self.durations[-1][1]} s (rank 0 at step "
                  f"{max(dict(self.rank0.losses()), default=0)} of {STEPS})", flush=True)
            wait_until(lambda: not self.stray_containers(), 90,
                       "no container of an old incarnation on a live node", interval=1)
            self.assert_checks_see_the_job()

    def wait_training(self) -> None:
        """Both workers printed a step past the newest printed so far."""
        marks = {p: newest_step(self.core, p) for p in self.pods()}
        wait_until(lambda: all(newest_step(self.core, p) > m for p, m in marks.items()), 120,
                   "both workers to train a step", interval=0.5)
        self.read_losses()

    def _recovered(self, kind: str, moved: tuple[str, str] | None = None) -> dict[str, Any]:
        last = wait_until(lambda: recovery_after(self.custom, self.epoch, self.name), 150,
                          f"the {kind} recovered", interval=0.5)
        assert (last["cause"], last["source"]) == EXPECTED[kind], (kind, last)
        self.epoch = int(last["epoch"])
        self.read_losses()
        for pod in self.pods():
            wait_until(lambda p=pod: resumed_at(trainer_log(self.core, p), last["restoredStep"]),
                       120, f"{pod} to step on from the restored step", interval=0.5)
        if moved is not None:  # (pod, the node it left)
            now = self.core.read_namespaced_pod(moved[0], NAMESPACE).spec.node_name
            assert now not in (moved[1], None), (moved, now)
        return last

    def _trainer(self) -> str:
        pod = self.rng.choice(sorted(self.pods()))
        kill_training_process(self.state_dir, NAMESPACE, pod)
        return f"{pod}, restored step {self._recovered('trainer')['restoredStep']}"

    def _away_from_operator(self) -> tuple[str, str]:
        """A worker not on the operator's node (one always is) and its node."""
        pods = self.pods()
        pod = self.rng.choice(sorted(n for n, p in pods.items()
                                     if p.spec.node_name != self.operator_node))
        return pod, pods[pod].spec.node_name

    def ensure_spare(self) -> None:
        """A Ready node with none of the job's pods, for the replacement."""
        started = time.monotonic()
        used = {p.spec.node_name for p in self.pods().values()}
        for name in ensure_free_nodes(self.state_dir, self.api, used, 1):
            print(f"kubelet soak: spare node {name} Ready in {time.monotonic() - started:.1f} s",
                  flush=True)

    def _node(self) -> str:
        self.ensure_spare()
        pod, node = self._away_from_operator()
        faults.lose_node(self.state_dir, node)
        last = self._recovered("node", moved=(pod, node))
        return f"{pod} on {node}, restored step {last['restoredStep']}"

    def _partition(self) -> str:
        self.ensure_spare()
        pod, node = self._away_from_operator()
        faults.partition_node(self.state_dir, node)
        try:
            last = self._recovered("partition", moved=(pod, node))
            self.read_losses()  # the cut-off pod's last lines, before its node removes them
        finally:
            faults.heal_node(self.state_dir, node)
        return f"{pod} on {node}, restored step {last['restoredStep']}"

    def _sidecar(self, hang_s: float = 0.0) -> str:
        pods = sorted(self.pods())
        pod = self.rng.choice(pods)
        (peer,) = set(pods) - {pod}
        mark = newest_step(self.core, pod)
        if hang_s:
            faults.kill_container(self.state_dir, NAMESPACE, pod, naming.SIDECAR_CONTAINER,
                                  sig=signal.SIGSTOP)
            time.sleep(hang_s)
            faults.kill_container(self.state_dir, NAMESPACE, pod, naming.SIDECAR_CONTAINER,
                                  sig=signal.SIGCONT)
        else:
            faults.kill_container(self.state_dir, NAMESPACE, pod, naming.SIDECAR_CONTAINER)
        wait_until(lambda: held_replicas(self.core, self.name, pod, mark) == {rank_of(peer)},
                   90, f"{pod}'s sidecar to hold its peer's replica again", interval=0.5)
        assert recovery_after(self.custom, self.epoch, self.name) is None, \
            "a sidecar failure needs no recovery"
        return pod

    def _sidecar_hang(self) -> str:
        return self._sidecar(self.rng.uniform(*HANG_S))

    # --- the end -----------------------------------------------------------------------------

    def finish_and_delete(self) -> dict[str, Any]:
        final = finished(self.custom, self.name, 600)
        self.read_losses()
        self.stop()
        self.custom.delete_namespaced_custom_object(naming.GROUP, naming.VERSION, NAMESPACE,
                                                    naming.PLURAL, self.name)
        wait_until(lambda: not self.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"{naming.LABEL_JOB}={self.name}").items, 120,
            "the job's pods gone")
        deadline = time.monotonic() + 90
        while (left := self.stray_containers() + self.mounted_volumes()) and \
                time.monotonic() < deadline:
            time.sleep(1)
        assert not left, f"left of the deleted job on live nodes: {left}"
        return final

    def mounted_volumes(self) -> list[str]:
        """Mounts of the job's pods' volumes on live nodes (a lost node's stay as it left
        them: its memory is gone with it in a real power loss)."""
        return [m for node in self.live_nodes() for m in kubelet.mounts_under(node.state_dir)
                if any(u in m for u in self.uids)]


def _running_tasks(node: kubelet.KubeletNode) -> set[str]:
    rows = [line.split() for line in node.ctr("tasks", "ls").splitlines()[1:]]
    return {row[0] for row in rows if len(row) >= 3 and row[2] == "RUNNING"}


def _containers(node: kubelet.KubeletNode, pod: str, uid: str | None = None) -> set[str]:
    labels = {"io.kubernetes.pod.namespace": NAMESPACE, "io.kubernetes.pod.name": pod}
    if uid:
        labels["io.kubernetes.pod.uid"] = uid
    wanted = ",".join(f'labels."{k}"=={v}' for k, v in labels.items())
    return set(node.ctr("containers", "ls", "-q", wanted).split())


def reference_in_background(shared_references: Any) -> Future[dict[int, str]]:
    """Rank 0's uninterrupted losses, computed while the soak runs."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(shared_references, 2, SOAK_MODEL, 900, 0)
    pool.shutdown(wait=False)
    return future
