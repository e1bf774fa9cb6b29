"""Issue 16, part 1, end to end: a pinned recoverable version with back-pressure.

A GeminiJob of 4 workers (m = 2, no S3) trains examples/train_gpt_zero3.py (DeepSpeed ZeRO-3,
through tests/e2e/padded_trainer.py: every shard carries PADDING_BYTES more, so replication
costs what this test wants without more training traffic) on nodes of its own. Once it runs,
every node of the job is put on a slow link (`gemini_local.faults.slow_link`, what `gemini
fault slow-link` does; spares too, before a replacement pod lands there) at a rate chosen
from the shard's bytes (the sidecar's inventory) and the iteration time measured before, so
that one replication takes about LAG_ITERATIONS iterations. The trainers then skip snapshots
together while the newest one is on its way: the effective interval (status.checkpoint)
grows above 1, and the version every holder has stays pinned.

Then node losses at seeded random moments: each a seeded 2-8 steps after the step the
previous recovery restored (once training passed it), of a node drawn at random among the
job's current nodes (a spare added first; the local cluster adds a fresh node per loss, and
isolated_nodes removes them all afterwards). Every recovery must come from memory (`Peers`,
also checked on every status.lastRecovery recorded, by epoch, and on every RecoveryFinished
event), restore at least the recoverable step the status showed and the oldest version the
sidecars had acknowledged just before the loss, and lose (status.lastRecovery.stepsLost) at
most the effective interval + 1 steps: the largest interval the status showed since the last
recovery or the sidecars said (sending.effective_interval) just before and after the loss.
The lag must hold through the losses (median interval at the losses >= 2); every rank's
trainer log says it restored each planned step, in order, and went on with the next one;
rank 0's losses equal an uninterrupted run's (float hex).

The second test heals the links halfway (HEALED_LOSSES, half before the heal): the effective
interval comes back to 1 (and stays there: median of the status samples after it), and the
losses after the heal lose at most 2 steps.

GEMINI_LAG_SEED=<seed> replays a printed sequence of moments and nodes (the cluster's own
timing still varies); GEMINI_LAG_LOSSES and GEMINI_LAG_HEALED_LOSSES change the counts.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gemini.control.client import ControlClient, ControlError
from gemini_local import faults
from gemini_operator.core import naming
from tests.cluster.test_operator import Jobs, sidecar_port
from tests.cluster.test_operator_recovery import ENV, log_texts, losses
from tests.e2e.padded_trainer import PADDING_ENV
from tests.fixtures.isolated_nodes import IsolatedNodes
from tests.fixtures.nodes import wait_until
from tests.fixtures.operator import OperatorThread
from tests.fixtures.trainers import RESTORED_LINE, STEP_LINE, SharedReferences
from tests.unit.operator.builders import make_job

LOSSES = int(os.environ.get("GEMINI_LAG_LOSSES") or 10)
HEALED_LOSSES = int(os.environ.get("GEMINI_LAG_HEALED_LOSSES") or 4)
# About 30 s per loss on 2 busy cores, plus a minute or two to start and finish each job.
# Node-agent twin of a kubelet-node proof: `./dev long` only (tests/proofs.py).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.long,
              pytest.mark.proves("lagging-replication"),
              pytest.mark.timeout(600 + 60 * max(LOSSES, HEALED_LOSSES))]

WORKERS = 4
REPLICAS = 2
# Per loss: 2-8 steps past the restored one, of which up to about twice the effective interval
# are trained again; the job must still be training when the last loss comes.
STEPS = 12 + 7 * max(LOSSES, HEALED_LOSSES)


def model(steps: int = STEPS) -> list[str]:
    """The example's arguments for a run of `steps` (the reference's losses of a shorter run
    are the first of a longer one's)."""
    return ["--engine", "deepspeed", "--steps", str(steps), "--layers", "1", "--d-model", "32"]


MODEL = model()


def steps_of(args: list[str]) -> int:
    return int(args[args.index("--steps") + 1])
STEP_SLEEP = 0.4
PADDING_BYTES = 8 << 20
LAG_ITERATIONS = 3.0  # one replication over the slow link, in iterations
GAP_STEPS = (2, 8)  # a loss comes this many steps (uniform) after the last restored step
MEASURE_STEPS = 5  # iterations timed before the link is slowed
PADDED_TRAINER = Path(__file__).resolve().with_name("padded_trainer.py")


@pytest.fixture(scope="module")
def reference(shared_references: SharedReferences) -> dict[int, str]:
    """Rank 0's losses of the plain example, uninterrupted, on loopback (same model and steps;
    neither the idle time per step nor the padding changes a loss)."""
    return shared_references(WORKERS, MODEL)


def _complete_lines(text: str) -> list[str]:
    """The lines of `text` that were written whole (a log is read while it grows)."""
    lines = text.split("\n")
    return [line.strip() for line in lines[:-1]]


@dataclass
class Loss:
    index: int
    rank: int
    node: str
    gap: int  # steps after the last restored step
    trained: int  # the newest step rank 0 printed when the node went
    recoverable: int | None  # status.checkpoint.recoverableStep just before
    acknowledged: int | None  # the oldest of the sidecars' acknowledged versions just before
    # The effective interval: the largest the status showed since the last recovery, and the
    # largest the sidecars said (sending.effective_interval) just before and just after.
    interval: int = 1
    last: dict[str, Any] = field(default_factory=dict)
    took: float = 0.0

    def line(self) -> str:
        last = self.last
        return (f"loss {self.index:2d}: rank {self.rank} ({self.node}) {self.gap} steps after "
                f"the last restore, at step {self.trained} (recoverable {self.recoverable}, "
                f"acknowledged {self.acknowledged}, interval {self.interval}): "
                f"{last.get('cause')}/{last.get('source')} restored {last.get('restoredStep')}, "
                f"stepsLost {last.get('stepsLost')}, redone "
                f"{self.trained - int(last.get('restoredStep') or 0)}, in {self.took:.1f} s "
                f"{last.get('breakdown')}")


class LaggingJob:
    """The job, its nodes and links, and what the test saw of it (every status read records
    the effective interval and any status.lastRecovery, by epoch)."""

    def __init__(self, jobs: Jobs, state_dir: Path, new_node: Callable[[], str], name: str,
                 seed: int, steps: int = STEPS) -> None:
        """`new_node()` adds a node for the job (a node agent or a real kubelet); its name.
        `steps`: the job's (its --steps)."""
        self.jobs, self.state_dir, self.new_node = jobs, state_dir, new_node
        self.name, self.seed, self.steps = name, seed, steps
        self.rng = random.Random(seed)
        self.rate: int | None = None  # bytes/s of every slow link while slowing
        self.slowed: list[str] = []
        self.intervals: list[tuple[float, int]] = []  # (monotonic, effectiveInterval)
        self.recoveries: dict[int, dict[str, Any]] = {}  # status.lastRecovery by epoch
        self.done: list[Loss] = []
        self.started = time.monotonic()

    # -- reads ---------------------------------------------------------------------------

    def say(self, what: str) -> str:
        return f"{what} (seed {self.seed}; replay with GEMINI_LAG_SEED={self.seed})"

    def status(self) -> dict[str, Any]:
        status = dict((self.jobs.get(self.name) or {}).get("status") or {})
        interval = (status.get("checkpoint") or {}).get("effectiveInterval")
        if interval is not None:
            self.intervals.append((time.monotonic(), int(interval)))
        last = status.get("lastRecovery")
        if last:
            self.recoveries.setdefault(int(last["epoch"]), dict(last))
        return status

    def checkpoint(self) -> dict[str, Any]:
        return dict(self.status().get("checkpoint") or {})

    def pods(self) -> dict[int, Any]:
        return {int(p.metadata.labels[naming.LABEL_RANK]): p for p in self.jobs.pods(self.name)
                if p.metadata.deletion_timestamp is None}

    def restarts(self, rank: int) -> list[tuple[int, int | None]]:
        """(step restored, the first step printed after it) for each restart of `rank`'s
        trainer, oldest first, from its logs (every pod of the rank, every epoch)."""
        out: list[tuple[int, int | None]] = []
        for text in log_texts(self.state_dir, self.jobs.ns, f"{self.name}-worker-{rank}"):
            for line in _complete_lines(text):
                if match := RESTORED_LINE.match(line):
                    out.append((int(match.group(1)), None))
                elif (match := STEP_LINE.match(line)) and out and out[-1][1] is None:
                    out[-1] = (out[-1][0], int(match.group(1)))
        return out

    def progress(self) -> tuple[int, int]:
        """(how many times rank 0 restored, the newest step it printed in its current run)."""
        count, newest = 0, 0
        for text in log_texts(self.state_dir, self.jobs.ns, f"{self.name}-worker-0"):
            for line in _complete_lines(text):
                if match := RESTORED_LINE.match(line):
                    count, newest = count + 1, int(match.group(1))
                elif match := STEP_LINE.match(line):
                    newest = int(match.group(1))
        return count, newest

    def newest_step(self) -> int:
        return self.progress()[1]

    def step_from(self, step: int) -> int | None:
        """Rank 0's newest step once it is `step` or later."""
        newest = self.newest_step()
        return newest if newest >= step else None

    def trained_to(self, restarts: int, step: int) -> bool:
        """Whether rank 0, restarted `restarts` times, printed `step` since (a restart more
        than that: stop waiting, the checks after the next recovery say what happened)."""
        count, newest = self.progress()
        return count > restarts or (count == restarts and newest >= step)

    def recovered_after(self, epoch: int) -> dict[str, Any] | None:
        """status.lastRecovery of a recovery that ended the launch epoch `epoch`."""
        last = self.status().get("lastRecovery")
        return dict(last) if last and int(last["epoch"]) > epoch else None

    def max_interval_since(self, since: float) -> int:
        seen = [i for at, i in self.intervals if at >= since]
        return max(seen, default=1)

    @property
    def token(self) -> str:
        secret: Any = self.jobs.core.read_namespaced_secret(naming.secret_name(self.name),
                                                            self.jobs.ns)
        return base64.b64decode(secret.data[naming.SECRET_TOKEN_KEY]).decode()

    def inventories(self, ranks: Collection[int] = range(WORKERS)) -> dict[int, dict[str, Any]]:
        """The sidecars' GET /inventory of `ranks`, side by side (over the slow links); the
        ones that answer within 5 s."""
        token, pods = self.token, self.pods()

        def read(rank: int) -> dict[str, Any] | None:
            try:  # signed with the job token (issue 45: no token on the wire)
                return ControlClient(pods[rank].status.pod_ip, sidecar_port(pods[rank]), token,
                                     timeout=5).call_json("/inventory")
            except ControlError:
                return None

        asked = [r for r in ranks if r in pods]
        with ThreadPoolExecutor(max_workers=max(1, len(asked))) as pool:
            docs = dict(zip(asked, pool.map(read, asked), strict=True))
        return {r: doc for r, doc in docs.items() if doc is not None}

    def shard_bytes(self) -> int | None:
        """The size of rank 0's newest complete local copy (its sidecar's inventory)."""
        doc = self.inventories([0]).get(0) or {}
        sizes = [int(c["bytes"]) for c in doc.get("local") or () if c.get("complete")]
        return max(sizes, default=None)

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll `predicate` (4 times a second: each poll reads the API and the logs) until
        it holds; fail with the seed and the job's status after `timeout` seconds."""
        try:
            return wait_until(predicate, timeout, what, interval=0.25)
        except AssertionError as err:
            status = (self.jobs.get(self.name) or {}).get("status")
            raise AssertionError(self.say(f"{err}; the job's status: {status}")) from None

    # -- acts ----------------------------------------------------------------------------

    def add_node(self) -> str:
        """A fresh node, on a slow link while the test slows links."""
        node = self.new_node()
        if self.rate is not None:
            self.slow(node)
        return node

    def slow(self, node: str) -> None:
        assert self.rate is not None
        faults.slow_link(self.state_dir, node, self.rate)
        self.slowed.append(node)

    def heal_links(self) -> None:
        for node in self.slowed:
            faults.heal_node(self.state_dir, node)
        self.slowed.clear()
        self.rate = None

    def start_lagging(self) -> float:
        """Time MEASURE_STEPS iterations, then slow every node of the job so that one
        replication takes about LAG_ITERATIONS of them; the iteration time (s)."""
        first: int = self.wait(partial(self.step_from, 2), 300, "training to reach step 2")
        began = time.monotonic()
        last: int = self.wait(partial(self.step_from, first + MEASURE_STEPS), 120,
                              f"{MEASURE_STEPS} more steps")
        iteration = (time.monotonic() - began) / (last - first)
        shard = self.wait(self.shard_bytes, 60, "rank 0's sidecar to say its shard's size")
        # A quiet link lets a second's worth through at once (the policer's bucket), and it
        # is quiet about half an iteration between two sends: half an iteration more.
        self.rate = max(1000, int(shard / ((LAG_ITERATIONS + 0.5) * iteration)))
        for pod in self.pods().values():
            self.slow(str(pod.spec.node_name))
        print(f"iteration {iteration:.2f} s, shard {shard / (1 << 20):.1f} MiB: every link "
              f"slowed to {self.rate / 1e6:.2f} MB/s ({shard / self.rate:.1f} s a replication)")
        return iteration

    def lose_nodes(self, count: int, base: int, bound: Callable[[int], int]) -> int:
        """`count` node losses, each a seeded GAP_STEPS after the step restored last (`base`
        at first) and once training passed it; `bound(interval)` is the most steps a
        recovery may lose. Returns the step restored last."""
        since = time.monotonic()
        for _ in range(count):
            index = len(self.done) + 1
            self.add_node()  # where the lost rank's replacement pod will run
            gap = self.rng.randint(*GAP_STEPS)
            rank = self.rng.randrange(WORKERS)
            target = base + gap
            assert target < self.steps - 3, self.say(
                f"loss {index} would come at step {target}, too near the end ({self.steps})")
            self.wait(partial(self.trained_to, index - 1, target), 300,
                      f"rank 0 to train to step {target} before loss {index}")
            before = self.status()
            assert before.get("state") == "Running" and not before.get("recovery"), (
                self.say(f"loss {index}: the job is not training undisturbed: {before}"))
            pod = self.pods()[rank]
            docs = self.inventories()
            sending = [doc["sending"] for doc in docs.values()]
            acked = [int(s["acknowledged_version"]) for s in sending]
            loss = Loss(index, rank, str(pod.spec.node_name), gap, self.newest_step(),
                        (before.get("checkpoint") or {}).get("recoverableStep"),
                        min(acked) if len(acked) == WORKERS else None)  # all, or unknown
            faults.lose_node(self.state_dir, loss.node)
            lost_at = time.monotonic()
            # The survivors' trainers stop at their next collective; by then the newest
            # snapshot is notified, and what they say of the interval stays until training
            # passes that snapshot again.
            time.sleep(1.0)
            sending += [doc["sending"] for doc in self.inventories(
                [r for r in range(WORKERS) if r != rank]).values()]
            loss.interval = max([self.max_interval_since(since),
                                 *(int(s["effective_interval"]) for s in sending)])
            epoch = int(before["launch"]["epoch"])
            loss.last = self.wait(partial(self.recovered_after, epoch), 300,
                                  f"the recovery from loss {index}")
            loss.took = time.monotonic() - lost_at
            since = time.monotonic()
            self.done.append(loss)
            print(loss.line())
            self.check(loss, bound)
            base = int(loss.last["restoredStep"])
            # The next loss comes once training runs again, past the restored step.
            self.wait(partial(self.trained_to, index, base + 1), 300,
                      f"rank 0 to train past the restored step {base} after loss {index}")
        return base

    def check(self, loss: Loss, bound: Callable[[int], int]) -> None:
        last = loss.last
        say = self.say(f"loss {loss.index}: {loss.line()}; {last}")
        assert last["cause"] == "hardware" and last["source"] == "Peers", say
        assert loss.rank in last["failedRanks"], say
        restored = last.get("restoredStep")
        assert restored is not None, say
        for pinned in (loss.recoverable, loss.acknowledged):  # survived the loss
            if pinned is not None and pinned >= 0:
                assert restored >= pinned, say
        assert last["stepsLost"] <= bound(loss.interval), (
            f"{say}: more than {bound(loss.interval)} steps lost")

    def finish(self, reference: dict[int, str]) -> dict[str, Any]:
        """Wait for the end; check every recovery recorded and rank 0's losses."""
        self.wait(lambda: self.status().get("state") in ("Succeeded", "Failed"), 600,
                  "the job to finish")
        status = self.status()
        assert status["state"] == "Succeeded", self.say(f"the job failed: {status}")
        # Every recovery, not only the ones waited for: by epoch, and by event.
        assert len(self.recoveries) == len(self.done), self.say(
            f"{len(self.recoveries)} recoveries recorded for {len(self.done)} losses: "
            f"{self.recoveries}")
        sources = {epoch: last["source"] for epoch, last in self.recoveries.items()}
        assert set(sources.values()) == {"Peers"}, self.say(f"not all from peers: {sources}")
        finished = [e.message for e in self.jobs.events(self.name)
                    if e.reason == "RecoveryFinished"]
        assert len(finished) == len(self.done), self.say(f"RecoveryFinished events: {finished}")
        assert all(" from peers " in m for m in finished), self.say(str(finished))
        # Every rank's trainer restored each planned step, in order, and went on from there.
        planned = [int(self.recoveries[e]["restoredStep"]) for e in sorted(self.recoveries)]
        for rank in range(WORKERS):
            restarts = self.restarts(rank)
            assert [step for step, _ in restarts] == planned, self.say(
                f"rank {rank}'s trainer restored {restarts}, the operator planned {planned}")
            assert all(after == step + 1 for step, after in restarts), self.say(
                f"rank {rank} did not go on with the step after the restored one: {restarts}")
        got, conflicts = losses(self.state_dir, self.jobs.ns, f"{self.name}-worker-0")
        assert not conflicts, self.say(f"a step printed again with another loss: {conflicts}")
        differ = sorted(s for s in reference.keys() | got.keys() if got.get(s) != reference.get(s))
        assert not differ, self.say(f"rank 0's losses differ from the uninterrupted run's at "
                                    f"steps {differ}")
        return status

    def summary(self) -> str:
        lost = [int(loss.last["stepsLost"]) for loss in self.done]
        steady = [i for _, i in self.intervals]
        return (f"{len(self.done)} losses in {time.monotonic() - self.started:.0f} s (seed "
                f"{self.seed}); sources {sorted({loss.last['source'] for loss in self.done})}; "
                f"stepsLost {lost} (median {statistics.median(lost) if lost else '-'}); "
                f"effective interval seen: max {max(steady, default=0)}, median "
                f"{statistics.median(steady) if steady else '-'}")


def new_seed() -> int:
    return int(os.environ.get("GEMINI_LAG_SEED") or time.time_ns() % 1_000_000)


@pytest.fixture
def lagging_job(isolated_nodes: IsolatedNodes, gemini_operator: OperatorThread,
                kube_api: client.ApiClient, job_namespace: str) -> Iterator[Any]:
    """make(name, losses): a lagging job on WORKERS nodes of its own; links healed and the
    job deleted afterwards (the nodes go with isolated_nodes)."""
    if os.geteuid() != 0 or not shutil.which("nft"):
        pytest.skip("slow links need root and nftables")
    made: list[LaggingJob] = []

    def make(name: str, count: int) -> LaggingJob:
        seed = new_seed()
        print(f"{name}: seed {seed}, {count} losses (replay: GEMINI_LAG_SEED={seed})")
        job = LaggingJob(Jobs(kube_api, job_namespace), Path(isolated_nodes.cluster.state_dir),
                         isolated_nodes.add, name, seed)
        for _ in range(WORKERS):
            isolated_nodes.add()
        body = (make_job(name).with_nodes(WORKERS).with_replicas(REPLICAS)
                .set("template.command", ["python", str(PADDED_TRAINER), *MODEL,
                                          "--step-sleep", str(STEP_SLEEP)])
                .set("template.env", [*ENV, {"name": PADDING_ENV, "value": str(PADDING_BYTES)}])
                .set("failurePolicy.maxRestarts", count + 5)
                .obj())
        job.jobs.create(body)
        made.append(job)
        return job

    yield make
    for job in made:
        job.heal_links()
        job.jobs.delete(job.name)


def start(job: LaggingJob) -> int:
    """Slow the links and wait until the interval grew and a version is pinned; the step
    rank 0 has then trained."""
    job.wait(lambda: job.status().get("launch"), 180, "the operator to start training")
    job.start_lagging()
    slowed_at = time.monotonic()

    def grown() -> dict[str, Any] | None:
        c = job.checkpoint()
        return c if c.get("effectiveInterval", 1) >= 2 and c.get("recoverableStep") else None

    checkpoint = job.wait(grown, 180, "the effective interval to grow above 1")
    print(f"lagging {time.monotonic() - slowed_at:.1f} s after the links were slowed: "
          f"{checkpoint}")
    return job.newest_step()


def test_node_losses_while_replication_lags_are_all_recovered_from_peer_memory(
    lagging_job: Any, reference: dict[int, str],
) -> None:
    job: LaggingJob = lagging_job("lag", LOSSES)
    base = start(job)
    job.lose_nodes(LOSSES, base, bound=lambda interval: interval + 1)
    # The lag held through the losses (the replacements' nodes were slowed too).
    intervals = [loss.interval for loss in job.done]
    assert statistics.median(intervals) >= 2, job.say(
        f"the effective interval at the losses: {intervals}")
    job.finish(reference)
    print("\n".join(loss.line() for loss in job.done))
    print(job.summary())


def test_after_the_link_heals_the_interval_comes_back_to_one(
    lagging_job: Any, reference: dict[int, str],
) -> None:
    job: LaggingJob = lagging_job("heal", HEALED_LOSSES)
    base = start(job)
    half = HEALED_LOSSES // 2
    base = job.lose_nodes(half, base, bound=lambda interval: interval + 1)
    job.heal_links()
    healed_at, step = time.monotonic(), job.newest_step()

    def back_to_one() -> dict[str, Any] | None:
        c = job.checkpoint()  # 1 again, and a version written since the heal acknowledged
        return c if c.get("effectiveInterval") == 1 and (
            c.get("recoverableStep") or 0) > step else None

    checkpoint = job.wait(back_to_one, 180, "the effective interval to come back to 1")
    print(f"interval back to 1 {time.monotonic() - healed_at:.1f} s after the heal: {checkpoint}")
    back = time.monotonic()
    job.lose_nodes(HEALED_LOSSES - half, base, bound=lambda interval: 2)
    after = [i for at, i in job.intervals if at >= back]
    assert statistics.median(after) == 1, job.say(f"the interval after the heal: {after}")
    job.finish(reference)
    print("\n".join(loss.line() for loss in job.done))
    print(f"{job.summary()}; after the heal: max {max(after)}, median "
          f"{statistics.median(after)} of {len(after)} samples")
