"""Soak: two DeepSpeed jobs side by side on the local cluster through many failures of random
kinds, each aimed at one of them (a lost or cut-off node hits both: they share the nodes).

How many: GEMINI_SOAK_FAILURES (default 6, what CI runs in the e2e layer: about 3 minutes);
`./dev soak` runs the long soak, 20 failures unless GEMINI_SOAK_FAILURES says more. Either
way every kind below comes at least once, in a random order.

Each failure is injected once training runs again after the previous recovery (rank 0 printed
a step past both the restored one and any printed before that failure), plus a random 0-2 s:
a killed trainer (recovered in place from local memory), a lost node (a spare added first;
recovered from the peers' replicas), a node cut off by a network partition (a spare added
first; replaced like a lost node, then healed: its agent ends the old pod's processes and the
node stays as a spare), a killed sidecar (restarted in place) or a hung one (stopped 2-8 s,
then resumed). Every recovery must be from memory, the sidecar failures need none (training
goes on and every shard's copies are complete again at a later step), the final
per-step losses equal an uninterrupted run's, and nothing leaks: after every recovery the
job's processes on the machine are exactly those of its current pods, and once the job is
deleted no pod, no process and no memory-backed emptyDir of its pods is left on a live node.

The seed is printed; GEMINI_SOAK_SEED=<seed> (with the same GEMINI_SOAK_FAILURES) replays
the same sequence of kinds, ranks and delays (the timing of the cluster itself still varies).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gemini_local import faults
from gemini_local.processes import is_alive
from gemini_operator.core import naming
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import ARGS, ENV, _recovered_after, losses
from tests.fixtures.isolated_nodes import IsolatedNodes
from tests.fixtures.operator import OperatorThread
from tests.fixtures.trainers import EXAMPLE, SharedReferences
from tests.unit.operator.builders import make_job

FAILURES = int(os.environ.get("GEMINI_SOAK_FAILURES") or 6)
# About 20 s per failure on a 2-core machine (load 6: 6 failures in 133 s, 45 s to set up);
# the limit leaves room for a busier one.
# A long count (`./dev soak`, `./dev long`); every kind it draws has its CI proof elsewhere.
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.soak, pytest.mark.long,
              pytest.mark.timeout(600 + 180 * FAILURES)]

WORKERS = 2
JOBS = ("soak-a", "soak-b")  # trained side by side, on the same nodes
# A failure aimed at a job uses 3-7 of its steps (a spare node added, the random delay, the
# recovery, a step past the restored one); the other job trains on meanwhile, about as many
# steps as the recovery takes seconds. 24 per failure leave a margin, and both jobs train on
# past the last failure.
STEPS = 24 * FAILURES + 12
SOAK_ARGS = [*ARGS[:ARGS.index("--steps")], "--steps", str(STEPS),
             *ARGS[ARGS.index("--steps") + 2:ARGS.index("--step-sleep")]]
KINDS = ("trainer", "node", "partition", "sidecar", "sidecar-hang")
# (cause, source) of the recovery each kind must end in; None: no recovery at all. A crashed
# sidecar restarts (native sidecar) and a hung one carries on once resumed: training goes on,
# and the shard copies the sidecar lost are complete again at a later step.
EXPECTED: dict[str, tuple[str, str] | None] = {
    "trainer": ("software", "Local"), "node": ("hardware", "Peers"),
    "partition": ("hardware", "Peers"), "sidecar": None, "sidecar-hang": None}
HANG_S = (2.0, 8.0)  # how long a hung sidecar stays stopped


def failure_kinds(rng: random.Random, count: int) -> list[str]:
    """`count` kinds in a random order: each of KINDS once (as far as `count` allows), the
    rest drawn at random, so a short soak covers every kind too."""
    kinds = [*KINDS[:count], *(rng.choice(KINDS) for _ in range(count - len(KINDS)))]
    rng.shuffle(kinds)
    return kinds


@pytest.fixture(scope="module")
def soak_reference(shared_references: SharedReferences) -> dict[int, str]:
    """Rank 0's losses of the same training, uninterrupted, without the idle time per step."""
    return shared_references(WORKERS, SOAK_ARGS)


def job_processes(namespace: str) -> set[tuple[str, str]]:
    """(rank, node) of every live process on this machine that runs for a pod of `namespace`
    (the node agents start containers with the pod's env, which names both)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                   if "=" in item)
        if env.get("GEMINI_NAMESPACE") == namespace and is_alive(int(proc.name)):
            found.add((env.get("GEMINI_RANK", "?"), env.get("GEMINI_NODE_NAME", "?")))
    return found


def pod_incarnations(jobs: Jobs, name: str) -> set[tuple[str, str]]:
    """(rank, node) of the job's pods that are not going away."""
    return {(p.metadata.labels[naming.LABEL_RANK], p.spec.node_name) for p in jobs.pods(name)
            if not p.metadata.deletion_timestamp and p.spec.node_name}


def shm_dirs(state_dir: Path, live_nodes: set[str], uids: set[str]) -> list[Path]:
    """Memory-backed emptyDirs of the pods `uids` left on live nodes' tmpfs."""
    from gemini_local.nodes import node_config

    out = []
    for node in live_nodes:
        base = Path(node_config(state_dir, node).shm_dir)
        out += [d for d in base.glob("*") if d.name in uids]
    return out


class Soak:
    def __init__(self, jobs: Jobs, name: str, cluster: Any, nodes: IsolatedNodes,
                 rng: random.Random) -> None:
        self.jobs, self.name, self.cluster, self.nodes, self.rng = jobs, name, cluster, nodes, rng
        self.lost: list[str] = []
        self.partitioned: list[str] = []
        self.uids: set[str] = set()
        self.seen: dict[int, str] = {}

    def rank0_losses(self) -> dict[int, str]:
        """Rank 0's losses so far: kept here, since a healed node deletes the logs of its
        replaced pod as a kubelet would. A step printed again must print the same loss."""
        got, conflicts = losses(self.cluster.state_dir, self.jobs.ns, f"{self.name}-worker-0")
        assert not conflicts
        for step, loss in got.items():
            assert self.seen.setdefault(step, loss) == loss, (step, self.seen[step], loss)
        return self.seen

    def newest_step(self) -> int:
        return max(self.rank0_losses(), default=0)

    def pods(self) -> dict[int, Any]:
        return {int(p.metadata.labels[naming.LABEL_RANK]): p
                for p in self.jobs.pods(self.name) if not p.metadata.deletion_timestamp}

    def inject(self, kind: str, rank: int) -> Callable[[], None]:
        """Prepare the failure (a spare for a node loss); return what injects it."""
        pod = self.pods()[rank]
        state = self.cluster.state_dir
        if kind in ("node", "partition"):
            self.nodes.add("zone-0")  # the spare the replacement pod will run on
        hang = self.rng.uniform(*HANG_S)

        def fire() -> None:
            if kind == "trainer":
                faults.kill_container(state, self.jobs.ns, pod.metadata.name,
                                      naming.TRAINER_CONTAINER)
            elif kind == "sidecar":
                faults.kill_container(state, self.jobs.ns, pod.metadata.name,
                                      naming.SIDECAR_CONTAINER)
            elif kind == "sidecar-hang":
                pid = faults.kill_container(state, self.jobs.ns, pod.metadata.name,
                                            naming.SIDECAR_CONTAINER, sig=signal.SIGSTOP)
                try:
                    time.sleep(hang)
                finally:
                    os.kill(pid, signal.SIGCONT)
            elif kind == "node":
                faults.lose_node(state, pod.spec.node_name)
                self.lost.append(pod.spec.node_name)
            else:
                faults.partition_node(state, pod.spec.node_name)
                self.partitioned.append(pod.spec.node_name)
        return fire

    def remember_pods(self) -> None:
        self.uids |= {p.metadata.uid for p in self.pods().values()}

    def rank_on(self, node: str) -> int | None:
        return next((r for r, p in self.pods().items() if p.spec.node_name == node), None)

    def heal(self) -> None:
        """Heal the partitioned nodes (after their recovery): they rejoin as spares."""
        self.rank0_losses()
        for node in self.partitioned:
            faults.heal_node(self.cluster.state_dir, node)
        self.partitioned.clear()

    def recovered_after(self, before: dict[str, Any]) -> Callable[[], Any]:
        return lambda: _recovered_after(self.jobs, self.name, before)

    def covered_after(self, step: int) -> Callable[[], Any]:
        """Every shard's copies complete again at a step after `step` (the poller's count)."""
        def covered() -> Any:
            status = (self.jobs.get(self.name) or {}).get("status") or {}
            coverage = (status.get("checkpoint") or {}).get("replicaCoverage") or {}
            done = coverage.get("total") and coverage.get("complete") == coverage["total"]
            return coverage if done and int(coverage.get("step") or 0) > step else None
        return covered


def soak_job(name: str) -> dict[str, Any]:
    return (make_job(name).with_nodes(WORKERS).with_replicas(2)
            .set("template.command", ["python", str(EXAMPLE), *SOAK_ARGS, "--step-sleep", "0.3"])
            .set("template.env", ENV)
            .set("failurePolicy.maxRestarts", FAILURES + 5)
            .obj())


def test_random_failures_are_all_recovered_with_identical_losses_and_nothing_leaks(
    local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
    job_namespace: str, soak_reference: dict[int, str], isolated_nodes: IsolatedNodes,
) -> None:
    seed = int(os.environ.get("GEMINI_SOAK_SEED") or time.time_ns() % 1_000_000)
    print(f"soak seed {seed}, {FAILURES} failures (replay: GEMINI_SOAK_SEED={seed} "
          f"GEMINI_SOAK_FAILURES={FAILURES})")
    rng = random.Random(seed)
    kinds = failure_kinds(rng, FAILURES)
    started = time.monotonic()
    for _ in range(WORKERS):  # both jobs share these nodes: a lost node hits both
        isolated_nodes.add("zone-0")
    jobs = Jobs(kube_api, job_namespace)
    for name in JOBS:
        jobs.create(soak_job(name))
    soaks = {name: Soak(jobs, name, local_cluster, isolated_nodes, rng) for name in JOBS}
    # From the first step in every rank's memory on, every failure is recoverable from memory.
    for name in JOBS:
        wait_for(lambda name=name: ((jobs.get(name) or {}).get("status") or {}).get(
            "checkpoint", {}).get("inMemoryStep"), 300, f"a first step of {name} in memory")
    log = []
    for i, kind in enumerate(kinds):
        running = [name for name in JOBS if jobs.state(name) == "Running"]
        assert running, f"both jobs finished before failure {i}: raise STEPS"
        target = soaks[rng.choice(running)]
        rank, delay = rng.randrange(WORKERS), rng.uniform(0.0, 2.0)
        node = target.pods()[rank].spec.node_name
        for soak in soaks.values():
            soak.remember_pods()
        fire = target.inject(kind, rank)
        time.sleep(delay)  # a random moment after the previous recovery finished
        before = {name: jobs.get(name)["status"] for name in JOBS}
        assert before[target.name]["state"] == "Running", (
            f"failure {i}: {target.name} is {before[target.name]['state']}")
        # A lost or cut-off node takes the pods of every job on it; the rest hit one job.
        hit = {name: soak.rank_on(node) for name, soak in soaks.items()
               if kind in ("node", "partition") and before[name]["state"] == "Running"
               and soak.rank_on(node) is not None}
        hit = hit or {target.name: rank}
        printed = {name: soak.newest_step() for name, soak in soaks.items()}
        fire()
        at = time.monotonic()
        what = f"failure {i} ({kind} of {target.name} rank {rank})"
        try:
            if EXPECTED[kind] is None:
                coverage = wait_for(target.covered_after(printed[target.name]), 300,
                                    f"every copy complete after {what}")
                log.append(f"{i:2d} {kind:12s} {target.name} rank {rank}: no recovery, copies "
                           f"complete at step {coverage['step']} in {time.monotonic() - at:.1f} s")
            for name, hit_rank in hit.items():
                if EXPECTED[kind] is None:
                    break
                last = wait_for(soaks[name].recovered_after(before[name]), 300,
                                f"the recovery of {name} after {what}")
                log.append(f"{i:2d} {kind:12s} {name} rank {hit_rank}: {last['cause']}/"
                           f"{last['source']} step {last.get('restoredStep')} lost "
                           f"{last['stepsLost']} in {time.monotonic() - at:.1f} s")
                assert (last["cause"], last["source"]) == EXPECTED[kind], last
                assert last.get("restoredStep") is not None, last  # not a fresh start
                # A killed trainer can take its peers' processes down with it (gloo sees the
                # socket close) and the operator may see one of theirs exit first; a lost node
                # is its rank.
                assert hit_rank in last["failedRanks"] or (
                    kind != "node" and last["failedRanks"]), last
        except AssertionError as err:  # say where the jobs got stuck
            raise AssertionError(f"{err}; the jobs' status: "
                                 f"{ {n: jobs.get(n)['status'] for n in JOBS} }") from err
        finally:
            for soak in soaks.values():
                soak.heal()
        print("\n".join(log[-len(hit):]))
        # Jobs the failure did not touch (and the target of a sidecar failure) never recover.
        for name in JOBS:
            if name not in hit or EXPECTED[kind] is None:
                after = jobs.get(name)["status"]
                assert (after.get("lastRecovery"), after["restarts"]) == (
                    before[name].get("lastRecovery"), before[name]["restarts"]), (name, after)
        # Only the current pods' processes run: none of a lost node's or a replaced pod's
        # (a healed node's agent ends those of its pod once it sees the pod deleted).
        wait_for(lambda: job_processes(job_namespace) == set().union(
            *(pod_incarnations(jobs, name) for name in JOBS)), 60,
            f"the processes to match the pods after failure {i}")
        # The next failure comes once training runs again, past what was printed before.
        for name in hit:
            last = jobs.get(name)["status"].get("lastRecovery") or {}
            past = max(printed[name], int(last.get("restoredStep") or 0))
            wait_for(lambda name=name, past=past: soaks[name].newest_step() > past, 300,
                     f"{name} training past step {past}")
    for name in JOBS:
        wait_for(lambda name=name: jobs.state(name) in ("Succeeded", "Failed"), 600,
                 f"{name} to finish")
        status = jobs.get(name)["status"]
        assert status["state"] == "Succeeded", (name, status)
        assert soaks[name].rank0_losses() == soak_reference, name
        soaks[name].remember_pods()
        jobs.delete(name)
    lost = [node for soak in soaks.values() for node in soak.lost]
    for node in lost:  # what the cloud does with a machine that is gone
        local_cluster.core.delete_node(node)
    wait_for(lambda: not any(jobs.pods(name) for name in JOBS), 120,
             "every pod of the jobs to be gone")
    wait_for(lambda: not job_processes(job_namespace), 60, "every process of the jobs to end")
    live = set(isolated_nodes.added) - set(lost)
    uids = set().union(*(soak.uids for soak in soaks.values()))
    # A node agent removes a pod's memory-backed emptyDirs just after it deleted the pod object
    # and ended its processes: what is left after that moment is a leak.
    try:
        wait_for(lambda: not shm_dirs(local_cluster.state_dir, live, uids), 30,
                 "the memory-backed emptyDirs of the jobs' pods to be removed")
    except AssertionError as err:
        raise AssertionError(f"{err}: {shm_dirs(local_cluster.state_dir, live, uids)}"
                             ) from None
    print("\n".join(log))
    print(f"soak: {FAILURES} failures of {len(JOBS)} jobs (seed {seed}) in "
          f"{time.monotonic() - started:.0f} s")
