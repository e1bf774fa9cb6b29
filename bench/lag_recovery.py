"""Node losses while replication lags: how often the operator would restore from memory.

Target (issue 16): with one replication taking about 3 iterations, the fraction of seeded
node losses recovered from memory is 1.0 (before the acknowledgement rule: about 0).

Real processes on loopback: 4 trainer ranks (a small torch model and SGD with momentum, plus
an `extra` tensor so that each rank's shard is BENCH_SHARD_MIB, default 8 MiB; gloo) and
beside each one a real `gemini sidecar` (m = 2, pairs placement from
gemini.domain.placement.mixed_placement, immediate traffic, 1 MiB chunks, no S3). Every
sidecar reaches its peer through a relay (bench/support/paced_relay.py) that paces the data
to shard / (BENCH_LAG x BENCH_ITER_S) bytes/s, and the trainers pace their iterations to
BENCH_ITER_S (default 0.3 s): one send takes about BENCH_LAG (3) iterations. The ratio
actually seen (the sidecars' `sending.peers[*].last_seconds` over the trainers' median
iteration) is printed.

Two runs, the same seeded loss moments in each:

  rule      the product's Checkpointer: the ranks reuse the older slot only once every
            rank's newest version is on its peer, else all skip the snapshot
  baseline  the rule off, as before it (emulated in this file: a Checkpointer whose
            `_agree_to_write` always says yes, so every rank overwrites its older slot at
            every step; the product has no switch for it)

After BENCH_WARMUP steps, BENCH_LOSSES (default 10) times, after a seeded random 1-3 s of
training, one node is lost (seeded): at that moment every trainer is stopped (SIGSTOP) and
the relays stop forwarding, so no copy anywhere changes; then the inventories of the three
surviving sidecars (GET /inventory; the lost node's shm and replicas are gone with it) go
through the operator's own conversion (gemini_operator.calls.worker_calls.inventory_copies) into
the domain planner (gemini.domain.recovery.plan_recovery, no S3 version): "recovered from
memory" is exactly a plan in mode memory, as the operator would decide. Then the relays and
trainers go on. The same frozen state is also planned for the loss of each of the 4 nodes
(a second, larger sample). Also reported: the steps a memory restore would lose (newest
step trained minus the planned version), the effective checkpoint interval (steps per
written snapshot, from SnapshotStats.skipped; and the sidecars' sending.effective_interval),
and, for the baseline, the sends the sidecars reported void (slot reused while sending).

BENCH_SEED (default 16), BENCH_LOSSES, BENCH_SHARD_MIB, BENCH_ITER_S, BENCH_LAG and
BENCH_WARMUP (default 10 steps) change the set-up. Every process and the temporary
directory (in /dev/shm) go away at the end, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.paced_relay import PacedRelay
from support.sidecar_procs import JOB, ROOT, TOKEN, free_port, wait_until

WORLD = 4
REPLICAS = 2
SEED = int(os.environ.get("BENCH_SEED", "16"))
LOSSES = int(os.environ.get("BENCH_LOSSES", "10"))
SHARD_BYTES = int(float(os.environ.get("BENCH_SHARD_MIB", "8")) * (1 << 20))
ITER_S = float(os.environ.get("BENCH_ITER_S", "0.3"))
LAG = float(os.environ.get("BENCH_LAG", "3"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "10"))
GAP_S = (1.0, 3.0)  # training between two losses, uniform
SETTLE_S = 0.05  # after the freeze: bytes the relay already forwarded land
MODES = ("rule", "baseline")
PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "trainer_sidecar")])


# -- the trainer side (one process per rank) -------------------------------------------------


def worker() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from gemini_trainer import Checkpointer

    class OverwritingCheckpointer(Checkpointer):
        """The rule off, as before issue 16: the older slot is reused at every step."""

        def _agree_to_write(self) -> bool:
            return True

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    blob = torch.from_numpy(
        np.random.default_rng(rank).integers(0, 256, SHARD_BYTES, dtype=np.uint8))
    kind = Checkpointer if os.environ["BENCH_MODE"] == "rule" else OverwritingCheckpointer
    ckpt = kind(model, opt)
    stop_file = Path(os.environ["BENCH_STOP"])
    stop = torch.zeros(1)
    step = 0
    with open(os.environ["BENCH_ROWS"], "a", buffering=1) as rows:
        previous = 0.0  # the whole previous iteration, its sleep included
        while True:
            start = time.perf_counter()
            gen = torch.Generator().manual_seed(step * WORLD + rank)
            x, y = torch.randn(32, 128, generator=gen), torch.randn(32, 1, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= WORLD
            opt.step()
            blob[step % blob.numel()] ^= 1  # the extra state changes every step, too
            stop[0] = float(stop_file.exists())
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            stats = ckpt.snapshot(step + 1, extra={"blob": blob})
            step += 1
            busy = time.perf_counter() - start
            rows.write(json.dumps({"step": step, "busy": busy, "previous": previous,
                                   "skipped": stats.skipped, "bytes": stats.nbytes}) + "\n")
            time.sleep(max(0.0, ITER_S - busy))  # iterations of ITER_S, unless slower
            previous = time.perf_counter() - start
    ckpt.close()
    dist.destroy_process_group()


# -- the bench -------------------------------------------------------------------------------


_LIBC = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL when the bench dies, whatever kills it."""
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Loss:
    gap_s: float
    node: int


@dataclass
class Verdict:
    node: int
    mode: str  # the planner's: memory | s3 | unrecoverable
    version: int | None
    trained: int  # the newest step any rank finished at the loss
    every_node: dict[int, str]  # the planner's mode for the loss of each node


@dataclass
class ModeRun:
    name: str
    verdicts: list[Verdict] = field(default_factory=list)
    send_s: list[float] = field(default_factory=list)
    effective: list[int] = field(default_factory=list)  # sending.effective_interval samples
    voided: int = 0  # sends the sidecars reported void (slot reused while sending)
    rows: list[list[dict[str, Any]]] = field(default_factory=list)


class World:
    """Sidecars, relays and trainers of one run; `close` ends them all (idempotent)."""

    def __init__(self, root: Path, mode: str) -> None:
        from gemini.domain.placement import mixed_placement

        self.root, self.mode = root, mode
        self.placement = mixed_placement(WORLD, REPLICAS)
        self.peer_ports = {r: free_port() for r in range(WORLD)}
        self.api_ports = {r: free_port() for r in range(WORLD)}
        self.relay = PacedRelay(self.peer_ports, SHARD_BYTES / (LAG * ITER_S))
        self.sidecars: list[subprocess.Popen[Any]] = []
        self.trainers: list[subprocess.Popen[Any]] = []
        self.stop_file = root / "stop"

    def shm(self, rank: int) -> Path:
        return self.root / "shm" / f"rank{rank}"

    def rows_path(self, rank: int) -> Path:
        return self.root / f"rows{rank}.jsonl"

    def start(self) -> None:
        peers = ",".join(f"{r}=127.0.0.1:{p}" for r, p in self.relay.ports.items())
        for rank in range(WORLD):
            self.shm(rank).mkdir(parents=True)
            env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
            env.update({
                "GEMINI_JOB": JOB, "GEMINI_RANK": str(rank), "GEMINI_WORLD_SIZE": str(WORLD),
                "GEMINI_AUTH_TOKEN": TOKEN, "GEMINI_MEMORY_BUDGET_BYTES": str(1 << 30),
                "GEMINI_PEERS": peers, "GEMINI_REPLICAS": str(REPLICAS),
                "GEMINI_HOLD_RANKS": ",".join(map(str, self.placement.receives_from(rank))),
                "GEMINI_SEND_TO": ",".join(map(str, self.placement.sends_to(rank))),
                "GEMINI_POD_IP": "127.0.0.1", "GEMINI_SIDECAR_PORT": str(self.peer_ports[rank]),
                "GEMINI_SIDECAR_API_PORT": str(self.api_ports[rank]),
                "GEMINI_SHM_DIR": str(self.shm(rank)), "GEMINI_TRAFFIC_MODE": "immediate",
                "GEMINI_CHUNK_BYTES": str(1 << 20),
            })
            code = ("import sys; from gemini_cli import main; "
                    "sys.exit(main(['sidecar', '--log-level', 'WARNING']))")
            with open(self.root / f"sidecar{rank}.log", "w") as log:
                self.sidecars.append(subprocess.Popen(
                    [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=log,
                    text=True, preexec_fn=_die_with_parent))
        for rank, car in enumerate(self.sidecars):
            assert car.stdout is not None
            if not car.stdout.readline():
                raise RuntimeError(f"sidecar {rank} did not start:\n{self.tail('sidecar', rank)}")
        port = free_port()
        for rank in range(WORLD):
            env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
            env.update({
                "RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "GEMINI_JOB": JOB, "GEMINI_AUTH_TOKEN": TOKEN,
                "GEMINI_SHM_DIR": str(self.shm(rank)),
                "GEMINI_SIDECAR_URL": f"http://127.0.0.1:{self.api_ports[rank]}",
                "GEMINI_PROFILE_ITERATIONS": "0", "BENCH_MODE": self.mode,
                "BENCH_ROWS": str(self.rows_path(rank)), "BENCH_STOP": str(self.stop_file),
            })
            with open(self.root / f"trainer{rank}.log", "wb") as log:
                self.trainers.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--worker"], env=env,
                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))
        self.relay.start()  # its thread only now: no fork while it runs

    def tail(self, what: str, rank: int) -> str:
        path = self.root / f"{what}{rank}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def check_alive(self) -> None:
        for kind, procs in {"trainer": self.trainers, "sidecar": self.sidecars}.items():
            for rank, proc in enumerate(procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"{kind} {rank} exited ({proc.returncode}):\n"
                                       f"{self.tail(kind, rank)}")

    def rows(self, rank: int) -> list[dict[str, Any]]:
        path = self.rows_path(rank)
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def trained(self) -> int:
        return max((r[-1]["step"] for r in map(self.rows, range(WORLD)) if r), default=0)

    def inventory(self, rank: int) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.api_ports[rank]}/inventory")
        req.add_header("Authorization", f"Bearer {TOKEN}")
        with urllib.request.urlopen(req, timeout=30) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
            return doc

    def signal_trainers(self, sig: signal.Signals) -> None:
        for proc in self.trainers:
            if proc.poll() is None:
                os.kill(proc.pid, sig)

    def lose(self, node: int) -> tuple[Verdict, list[dict[str, Any]]]:
        """Freeze every copy (trainers stopped, relays shut), plan the loss of `node` as the
        operator would, and of every other node as a second sample; then go on."""
        from gemini.control.inventory import Inventory
        from gemini.domain.recovery import plan_recovery
        from gemini_operator.calls.worker_calls import inventory_copies

        self.relay.pause()
        self.signal_trainers(signal.SIGSTOP)
        try:
            time.sleep(SETTLE_S)
            docs = {r: self.inventory(r) for r in range(WORLD)}
            trained = self.trained()
        finally:
            self.signal_trainers(signal.SIGCONT)
            self.relay.resume()
        plans = {}
        for lost in range(WORLD):
            survivors = {r: Inventory.from_json(d) for r, d in docs.items() if r != lost}
            plans[lost] = plan_recovery(REPLICAS, self.placement, [lost], [lost],
                                        inventory_copies(survivors), [])
        plan = plans[node]
        verdict = Verdict(node, plan.mode, plan.version, trained,
                          {n: p.mode for n, p in plans.items()})
        return verdict, list(docs.values())

    def finish(self) -> list[list[dict[str, Any]]]:
        self.stop_file.write_text("")
        deadline = time.monotonic() + 60
        for proc in self.trainers:
            with contextlib.suppress(subprocess.TimeoutExpired):  # killed in close()
                proc.wait(max(1.0, deadline - time.monotonic()))
        return [self.rows(r) for r in range(WORLD)]

    def close(self) -> None:
        signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # a second Ctrl-C waits for this
        try:
            for proc in [*self.trainers, *self.sidecars]:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
            for proc in [*self.trainers, *self.sidecars]:
                proc.wait()
            self.relay.close()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def run_mode(mode: str, root: Path, losses: list[Loss]) -> ModeRun:
    world = World(root, mode)
    run = ModeRun(mode)
    try:
        world.start()
        rate = world.relay.rate / (1 << 20)
        print(f"[{mode}] started 4 trainers and 4 sidecars; relay {rate:.1f} MiB/s per link, "
              f"shard {SHARD_BYTES >> 20} MiB, iteration {ITER_S} s", flush=True)

        def warm() -> bool:
            world.check_alive()
            return world.trained() >= WARMUP

        began = time.monotonic()
        wait_until(warm, 300, 0.1)
        print(f"[{mode}] step {world.trained()} after {time.monotonic() - began:.0f} s "
              f"(start-up and {WARMUP} warm-up steps)", flush=True)
        for i, loss in enumerate(losses):
            end = time.monotonic() + loss.gap_s
            while time.monotonic() < end:
                world.check_alive()
                time.sleep(0.05)
            verdict, docs = world.lose(loss.node)
            run.verdicts.append(verdict)
            for doc in docs:
                sending = doc["sending"]
                run.effective.append(int(sending["effective_interval"]))
                run.send_s += [p["last_seconds"] for p in sending["peers"].values()
                               if p["last_seconds"] > 0]
                run.voided += sum("overwritten" in p["last_error"]
                                  for p in sending["peers"].values())
            behind = "-" if verdict.version is None else verdict.trained - verdict.version
            print(f"[{mode}] loss {i + 1}/{len(losses)}: node {loss.node} at step "
                  f"{verdict.trained}: {verdict.mode} (version {verdict.version}, {behind} steps "
                  f"behind); any node: {''.join(m[0] for m in verdict.every_node.values())}",
                  flush=True)
        run.rows = world.finish()
    finally:
        world.close()
    return run


def fraction(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def summary(run: ModeRun) -> dict[str, Any]:
    recovered = [v.mode == "memory" for v in run.verdicts]
    every = [m == "memory" for v in run.verdicts for m in v.every_node.values()]
    behind = [v.trained - v.version for v in run.verdicts if v.version is not None]
    ranks = [rows[WARMUP:] for rows in run.rows]  # steady state, after the warm-up
    lockstep = list(zip(*ranks, strict=False))
    iteration = statistics.median(max(r["previous"] for r in step) for step in lockstep)
    written = sum(1 for step in lockstep if not step[0]["skipped"])
    send = statistics.median(run.send_s) if run.send_s else None
    return {
        "fraction": fraction(recovered), "every_node_fraction": fraction(every),
        "losses": len(recovered), "median_steps_behind": statistics.median(behind)
        if behind else None,
        "iteration_s": iteration, "send_s": send,
        "send_over_iteration": send / iteration if send else None,
        "steps": len(lockstep), "snapshots_written": written,
        "skipped": len(lockstep) - written,
        "effective_interval": len(lockstep) / written if written else None,
        "sidecar_effective_interval": statistics.median(run.effective) if run.effective
        else None,
        "voided_sends_seen": run.voided,
    }


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main() -> None:
    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with `&`
    rng = random.Random(SEED)
    losses = [Loss(rng.uniform(*GAP_S), rng.randrange(WORLD)) for _ in range(LOSSES)]
    root = Path(tempfile.mkdtemp(prefix="gemini-lag-", dir="/dev/shm"))
    started = time.monotonic()
    runs: dict[str, ModeRun] = {}
    try:
        for mode in MODES:
            runs[mode] = run_mode(mode, root / mode, losses)
    except (KeyboardInterrupt, SystemExit):
        print("interrupted: every process of the bench ended", file=sys.stderr)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = {mode: summary(run) for mode, run in runs.items()}
    load = os.getloadavg()
    for mode in MODES:
        s = res[mode]
        print(f"{mode:8s}: recovered from memory {s['fraction']:.2f} of {s['losses']} seeded "
              f"losses ({s['every_node_fraction']:.2f} planning the loss of each node), "
              f"median {fmt(s['median_steps_behind'], 0)} steps behind; iteration "
              f"{s['iteration_s']:.3f} s, send {fmt(s['send_s'])} s (ratio "
              f"{fmt(s['send_over_iteration'])}); effective interval "
              f"{fmt(s['effective_interval'])} ({s['skipped']} of {s['steps']} snapshots "
              f"skipped; sidecars' median {fmt(s['sidecar_effective_interval'], 0)}); void sends "
              f"seen {s['voided_sends_seen']}")
    print("baseline = the rule off, emulated in this bench (a Checkpointer whose _agree_to_write "
          "always says yes: every rank overwrites its older slot at every step); no send of "
          "the baseline completes when it takes more than 2 iterations, hence no send time")
    print(f"took {time.monotonic() - started:.0f} s; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}")
    rule, base = res["rule"], res["baseline"]
    print(json.dumps({
        "metric": "node_losses_recovered_from_memory_with_lagging_replication",
        "value": round(rule["fraction"], 3), "target": 1.0, "better": "higher",
        "unit": "fraction",
        "baseline_without_rule": round(base["fraction"], 3),
        "every_node": {m: round(res[m]["every_node_fraction"], 3) for m in MODES},
        "losses": rule["losses"], "seed": SEED,
        "send_over_iteration": round(rule["send_over_iteration"] or 0.0, 2),
        "iteration_s": round(rule["iteration_s"], 3),
        "send_s": round(rule["send_s"] or 0.0, 3),
        "effective_interval": round(rule["effective_interval"] or 0.0, 2),
        "sidecar_effective_interval": rule["sidecar_effective_interval"],
        "median_steps_behind": rule["median_steps_behind"],
        "shard_mib": SHARD_BYTES / (1 << 20),
        "load_1min": round(load[0], 2),
    }))


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
