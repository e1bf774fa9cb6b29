"""Per-iteration checkpointing overhead: a ~20M-parameter GPT, ZeRO-3, 2 ranks, m = 2.

Target (issue 4): iteration time with a checkpoint forced every iteration and interleaved
replication, over the iteration time without checkpointing, <= 1.10 (median iterations).

One launch of two trainer processes (examples/train_gpt_zero3.py's model and data; DeepSpeed
ZeRO-3 on CPU/gloo) and two pairs of real `gemini sidecar` processes: pair A replicates
interleaved (the default traffic mode, scheduled into the idle spans the trainer profiled),
pair B immediately. Each rank has two Checkpointers on the same engine, one per pair (each
with its own shm directory). After a warm-up that profiles 20 iterations for pair A, blocks of
BLOCK iterations cycle through the modes, so that drift on this shared machine hits all modes
alike:

  none         no snapshot (the baseline)
  interleaved  snapshot every iteration, pair A (forced: every version is offered; the ranks
               skip together while the newest one is not on its peer yet, and the output
               counts those skips per mode)
  immediate    snapshot every iteration, pair B (all chunks sent at once, for comparison)
  default      pair A, a snapshot every k iterations, k = the interval the sidecar's plan
               reports (interval_iterations): 1 when the traffic fits the idle spans; larger
               only when it does not, and the output says so

Between blocks the bench waits until the sidecars are idle (outside the timing), so one mode's
traffic does not land in the next one's iterations. The first iteration of each block is not
counted. When the interleaved plan spreads a version over more iterations than a block has,
part of its traffic runs during that wait: the iteration ratio then understates it, and the
sidecar CPU figure (measured over block and wait, per iteration of the block) shows it.

Where the time goes: per mode, the median compute (forward, backward, step), the median
snapshot stall (the copy into shm), and the CPU seconds the two sidecars of the mode
used per iteration; on these 2 cores that CPU is taken from training.
BENCH_CYCLES (default 4) and BENCH_BLOCK (default 4) set the number of iterations.
Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.cleanup import cleaning_up
from support.sidecar_procs import JOB, ROOT, TOKEN, SidecarProc, free_port, wait_until

MODEL = ["--engine", "deepspeed", "--layers", "6", "--d-model", "512", "--heads", "8",
         "--vocab", "256", "--seq", "64", "--batch", "4", "--dropout", "0.0"]
CYCLES = int(os.environ.get("BENCH_CYCLES", "4"))
BLOCK = int(os.environ.get("BENCH_BLOCK", "4"))
WARMUP = 22  # > the 20 iterations the Checkpointer profiles for the interleaved pair
MODES = ("none", "interleaved", "immediate", "default")


# -- the trainer side (one process per rank) -------------------------------------------------


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" /
                                                  "train_gpt_zero3.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(plan_path: Path, out_path: Path) -> None:
    from dataclasses import replace

    from gemini_trainer import Checkpointer
    from gemini_trainer.checkpointer_config import CheckpointerConfig

    ex = _example()
    args = ex.parse(MODEL)
    engine, _, _ = ex.build(args)
    rank = int(os.environ["RANK"])
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                 for p in engine.module.parameters())
    base = CheckpointerConfig.from_env()
    pairs = json.loads(os.environ["BENCH_PAIRS"])  # name -> {"shm": dir, "url": sidecar url}
    ckpt = {
        "A": Checkpointer(engine, config=replace(base, shm_dir=Path(pairs["A"]["shm"]),
                                                 sidecar_url=pairs["A"]["url"])),
        "B": Checkpointer(engine, config=replace(base, shm_dir=Path(pairs["B"]["shm"]),
                                                 sidecar_url=pairs["B"]["url"],
                                                 profile_iterations=0)),
    }
    step = 0
    rows: list[dict[str, Any]] = []

    def iteration(mode: str, snap: Checkpointer | None) -> None:
        nonlocal step
        start = time.perf_counter()
        x, y = ex.batch(args, step, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss.item()
        compute = time.perf_counter() - start
        stats = snap.snapshot(step + 1) if snap is not None else None
        rows.append({"mode": mode, "step": step, "seconds": time.perf_counter() - start,
                     "compute": compute, "stall": stats.stall_s if stats else 0.0,
                     "skipped": bool(stats and stats.skipped)})
        step += 1

    for _ in range(WARMUP):
        iteration("warmup", ckpt["A"])
    barrier(plan_path, rank, "warm")
    for cycle in range(CYCLES):
        for mode in MODES:
            interval = wait_for_plan(plan_path, f"{cycle}-{mode}")
            snap = {"none": None, "interleaved": ckpt["A"], "immediate": ckpt["B"],
                    "default": ckpt["A"]}[mode]
            every = interval if mode == "default" else 1
            for i in range(BLOCK):
                iteration(mode, snap if (step + 1) % every == 0 else None)
                rows[-1]["first"] = i == 0
            for c in ckpt.values():
                c.flush()
            barrier(plan_path, rank, f"{cycle}-{mode}-done")
    for c in ckpt.values():
        c.close()
    out_path.write_text(json.dumps({"rank": rank, "params": params, "rows": rows}))


def barrier(plan_path: Path, rank: int, name: str) -> None:
    """Tell the bench this rank reached `name` (a file); the bench releases the next block."""
    (plan_path.parent / f"rank{rank}.{name}").write_text("")


def wait_for_plan(plan_path: Path, name: str) -> int:
    """Wait until the bench released block `name`; returns the default policy's interval."""
    go = plan_path.parent / f"go.{name}"
    while not go.exists():
        time.sleep(0.01)
    return int(go.read_text() or "1")


# -- the bench (sidecars, launch, report) ----------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle(cars: list[SidecarProc]) -> bool:
    for car in cars:
        sending = car.api("GET", "/inventory")["sending"]
        acked = [p["acked_version"] for p in sending["peers"].values()]
        busy = any(p["sending_version"] >= 0 for p in sending["peers"].values())
        if busy or (sending["notified_version"] >= 0 and min(acked, default=-1)
                    < sending["notified_version"] and not any(
                        p["last_error"] for p in sending["peers"].values())):
            return False
    return True


def run() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gemini-overhead-", dir="/dev/shm"))
    sync = root / "sync"
    sync.mkdir()
    pairs: dict[str, list[SidecarProc]] = {}
    for name, mode in (("A", "interleaved"), ("B", "immediate")):
        ports = {0: free_port(), 1: free_port()}
        pairs[name] = [
            SidecarProc(r, 2, root / name, ports, hold=str(1 - r), send_to=str(1 - r),
                        extra={"GEMINI_TRAFFIC_MODE": mode})
            for r in (0, 1)
        ]
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ)
            env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       GEMINI_JOB=JOB, GEMINI_AUTH_TOKEN=TOKEN,
                       PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "trainer_sidecar")]),
                       BENCH_PAIRS=json.dumps({
                           n: {"shm": str(cars[rank].shm_dir),
                               "url": f"http://127.0.0.1:{cars[rank].api_port}"}
                           for n, cars in pairs.items()}))
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", str(sync / "plan"),
                 str(root / f"out{rank}.json")], env=env))

        def reached(name: str) -> bool:
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("a trainer failed")
            return all((sync / f"rank{r}.{name}").exists() for r in (0, 1))

        wait_until(lambda: reached("warm"), 1800, 0.05)
        wait_until(lambda: idle(pairs["A"]) and idle(pairs["B"]), 600, 0.05)
        sending = pairs["A"][0].api("GET", "/inventory")["sending"]
        interval = int(sending["interval_iterations"] or 1)
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        for cycle in range(CYCLES):
            for mode in MODES:
                cars = pairs["B"] if mode == "immediate" else pairs["A"]
                before = sum(cpu_seconds(c.proc.pid) for c in cars)
                (sync / f"go.{cycle}-{mode}").write_text(str(interval))
                wait_until(lambda n=f"{cycle}-{mode}-done": reached(n), 1800, 0.01)
                wait_until(lambda cs=cars: idle(cs), 600, 0.05)
                cpu[mode].append(sum(cpu_seconds(c.proc.pid) for c in cars) - before)
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError("a trainer failed")
        status = {n: cars[0].api("GET", "/inventory")["sending"] for n, cars in pairs.items()}
        results = [json.loads((root / f"out{r}.json").read_text()) for r in (0, 1)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for cars in pairs.values():
            for car in cars:
                car.stop()
        for path in sorted(root.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        root.rmdir()
    return {"results": results, "cpu": cpu, "status": status, "interval": interval}


def summarize(data: dict[str, Any]) -> None:
    # both ranks move in lockstep (collectives); the slower one is the iteration time
    rows = list(zip(*(r["rows"] for r in data["results"]), strict=True))
    per_mode: dict[str, dict[str, list[float]]] = {m: {"seconds": [], "compute": [],
                                                       "stall": []} for m in MODES}
    for pair in rows:
        mode = pair[0]["mode"]
        if mode not in per_mode or pair[0].get("first"):
            continue
        for key in ("seconds", "compute", "stall"):
            per_mode[mode][key].append(max(row[key] for row in pair))
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in per_mode.items()}
    # Snapshots the ranks skipped together (the newest version was not on its peer yet):
    # those iterations copied nothing, so the ratio is only honest beside this count.
    skipped = {m: sum(1 for pair in rows if pair[0]["mode"] == m and pair[0].get("skipped"))
               for m in MODES}
    iters = CYCLES * BLOCK
    base = med["none"]["seconds"]
    params = data["results"][0]["params"]
    print(f"model: {params / 1e6:.1f}M parameters, ZeRO-3, 2 ranks, m = 2; "
          f"{CYCLES} cycles x {BLOCK} iterations per mode (first of each block dropped)")
    for mode in MODES:
        m = med[mode]
        sidecar_cpu = sum(data["cpu"][mode]) / iters
        print(f"{mode:12s} iteration {m['seconds'] * 1e3:8.1f} ms  ratio "
              f"{m['seconds'] / base:5.3f}  compute {m['compute'] * 1e3:8.1f} ms  stall "
              f"{m['stall'] * 1e3:6.1f} ms  sidecar CPU {sidecar_cpu * 1e3:7.1f} ms/iteration"
              f"  skipped {skipped[mode]}/{iters}")
    for name, status in data["status"].items():
        print(f"pair {name} ({status['mode']}): skipped (coalesced) versions "
              f"{status['skipped_versions']}, fits idle spans {status['fits_idle_spans']}, "
              f"interval {status['interval_iterations']}: {status['plan']}")
    print(f"default policy: a checkpoint every {data['interval']} iteration(s)"
          + ("" if data["interval"] == 1 else " (lengthened: the traffic does not fit)"))
    ratio = med["interleaved"]["seconds"] / base
    print(json.dumps({
        "metric": "checkpoint_every_iteration_overhead_ratio", "value": round(ratio, 3),
        "target": 1.10, "better": "lower", "unit": "ratio",
        "immediate_ratio": round(med["immediate"]["seconds"] / base, 3),
        "default_policy_ratio": round(med["default"]["seconds"] / base, 3),
        "default_interval_iterations": data["interval"],
        "baseline_iteration_s": round(base, 4),
        "stall_s": round(med["interleaved"]["stall"], 4),
        "skipped_snapshots": skipped,
        "params": params,
        "load_1min": round(os.getloadavg()[0], 2),
    }))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    with cleaning_up():  # sidecars and trainers stopped, also when interrupted
        results = run()
    summarize(results)


if __name__ == "__main__":
    main()
