"""Peer replication throughput of a 1 GiB shard: two sidecar processes vs raw TCP.

Target (issue 4): sidecar-to-sidecar throughput >= 0.9 x the throughput of a plain Python
TCP transfer between two processes on the same path (loopback), same bytes, same run.

Baseline: a receiver process recv_into()s into a prefaulted 1 GiB buffer, a sender process
sendall()s the same shard straight from the trainer's shared-memory slot, acknowledged with
one byte. Sidecar: the bench commits a new version into rank 0's slot file (as the trainer
does), POSTs /notify, and reads rank 0's own measurement of that send (first byte out to the
peer's final acknowledgement, the CRC-32 and the AES-GMAC tag of every chunk included) from
/inventory. Two warm-up versions allocate the receiver's two replica slots first, as in steady
state. Raw and sidecar runs alternate, RUNS each. The figure is the median of the per-pair
ratios (each sidecar run over the raw run just before it), which cancels most of the drift of
a machine shared with other work; the medians of each side are printed too, with the CPU
seconds each transfer used.

A third transfer per round, "raw + CRC-32", is the raw one with the receiver taking the
CRC-32 of each piece as it lands on a second thread: a transfer that checks every byte with
CRC-32 and no MAC. It is reported beside the target ratio (`vs_raw_crc32`), not in it.
BENCH_BYTES and BENCH_RUNS override the size and the number of pairs. `--encrypt` runs the
sidecars with GEMINI_PEER_ENCRYPTION=on (AES-256-CTR on both ends, spec.checkpoint.peerEncryption):
the metric is then named `..._encrypted`, against the same plain raw TCP baseline.
Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.cleanup import cleaning_up
from support.sidecar_procs import (
    JOB,
    ROOT,
    SidecarProc,
    commit_version,
    free_port,
    pattern,
    wait_until,
)

SIZE = int(os.environ.get("BENCH_BYTES", str(1 << 30)))
RUNS = int(os.environ.get("BENCH_RUNS", "7"))
GIB = float(1 << 30)

RAW_RECEIVER = """
import socket, sys
size, port, crc = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "crc"
buf = bytearray(size)
buf[:] = b"\\1" * size  # prefault, like the sidecar's reused replica buffers
view = memoryview(buf)
ls = socket.socket(); ls.bind(("127.0.0.1", port)); ls.listen(1)
print("ready", flush=True)
conn, _ = ls.accept()
import queue, threading, time
from isal import isal_zlib
pieces = queue.SimpleQueue()
def crc_pieces():
    c = 0
    while (piece := pieces.get()) is not None:
        c = isal_zlib.crc32(piece, c)
worker = threading.Thread(target=crc_pieces)
worker.start()
cpu = time.process_time()
got = queued = 0
while got < size:
    n = conn.recv_into(view[got:])
    if n == 0:
        raise SystemExit("sender went away")
    got += n
    if crc and (got - queued >= 1 << 20 or got == size):
        pieces.put(view[queued:got])
        queued = got
pieces.put(None)
worker.join()
conn.sendall(b"k")
print(time.process_time() - cpu, flush=True)
"""

RAW_SENDER = """
import socket, sys, time
sys.path[:0] = sys.argv[3:5]
from gemini.slots.shard import ShardSlots
path, port = sys.argv[1], int(sys.argv[2])
slots = ShardSlots(path)
info = slots.latest_complete()
view = slots.read(info.version)
cpu = time.process_time()
start = time.perf_counter()
s = socket.create_connection(("127.0.0.1", port))
s.sendall(view)
assert s.recv(1) == b"k"
print(time.perf_counter() - start, time.process_time() - cpu, flush=True)
"""


def cpu_seconds(pid: int) -> float:  # for the sidecars (their CPU time includes the API)
    """User + system CPU time of a live process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_run(slot_path: Path, crc: bool = False) -> tuple[float, float]:
    """(GiB/s, CPU seconds of both processes during the transfer)."""
    port = free_port()
    recv = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(SIZE), str(port),
                             "crc" if crc else "plain"], stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    send = subprocess.run(
        [sys.executable, "-c", RAW_SENDER, str(slot_path), str(port), str(ROOT),
         str(ROOT / "trainer_sidecar")], capture_output=True, text=True, check=True)
    seconds, send_cpu = map(float, send.stdout.split())
    recv_cpu = float(recv.stdout.readline())
    recv.wait(60)
    return SIZE / seconds / GIB, send_cpu + recv_cpu


def sidecar_run(sender: SidecarProc, holder: SidecarProc, slots, version: int, data
                ) -> tuple[float, float]:
    commit_version(slots, version, data)
    cpu0 = cpu_seconds(sender.proc.pid) + cpu_seconds(holder.proc.pid)
    sender.api("POST", "/notify", {"version": version})

    def acked() -> bool:
        peer = sender.api("GET", "/inventory")["sending"]["peers"].get("1", {})
        if peer.get("last_error"):
            raise RuntimeError(f"replication failed: {peer['last_error']}")
        return bool(peer.get("acked_version") == version)

    wait_until(acked, every=0.2)  # rare polls: the API shares the sender's event loop and CPU
    cpu = cpu_seconds(sender.proc.pid) + cpu_seconds(holder.proc.pid) - cpu0
    seconds = sender.api("GET", "/inventory")["sending"]["peers"]["1"]["last_seconds"]
    return SIZE / float(seconds) / GIB, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encrypt", action="store_true",
                        help="sidecars encrypt their payloads (GEMINI_PEER_ENCRYPTION=on)")
    args = parser.parse_args()
    with cleaning_up():  # the sidecars and raw TCP processes stopped, also when interrupted
        measure(args.encrypt)


def measure(encrypt: bool) -> None:
    shm_root = Path(tempfile.mkdtemp(prefix="gemini-bench-", dir="/dev/shm"))
    ports = {0: free_port(), 1: free_port()}
    extra = {"GEMINI_PEER_ENCRYPTION": "on" if encrypt else "off"}
    sender = SidecarProc(0, 2, shm_root, ports, send_to="1", extra=extra)
    holder = SidecarProc(1, 2, shm_root, ports, hold="0", extra=extra)
    slots = sender.slots(SIZE)
    data = pattern(SIZE, 1)
    raw_rates, car_rates, raw_cpu, car_cpu, crc_rates, crc_cpu = [], [], [], [], [], []
    try:
        for version in (1, 2):  # warm-up: both replica slots allocated
            sidecar_run(sender, holder, slots, version, data)
        for i in range(RUNS):
            rate, cpu = raw_run(slots.path)
            raw_rates.append(rate)
            raw_cpu.append(cpu)
            rate, cpu = sidecar_run(sender, holder, slots, 3 + i, data)
            car_rates.append(rate)
            car_cpu.append(cpu)
            rate, cpu = raw_run(slots.path, crc=True)
            crc_rates.append(rate)
            crc_cpu.append(cpu)
            print(f"run {i}: raw {raw_rates[-1]:.2f} GiB/s ({raw_cpu[-1]:.2f} CPU s), "
                  f"sidecar {car_rates[-1]:.2f} GiB/s ({car_cpu[-1]:.2f} CPU s), "
                  f"raw + CRC-32 {crc_rates[-1]:.2f} GiB/s ({crc_cpu[-1]:.2f} CPU s)",
                  flush=True)
        inv = holder.api("GET", "/inventory")
        newest = max(r["version"] for r in inv["replicas"] if r["complete"])
        assert newest == 2 + RUNS, inv["replicas"]
    finally:
        slots.close()
        sender.stop()
        holder.stop()
        for path in sorted(shm_root.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        shm_root.rmdir()
    raw, car = statistics.median(raw_rates), statistics.median(car_rates)
    ratio = statistics.median(c / r for c, r in zip(car_rates, raw_rates, strict=True))
    vs_crc = statistics.median(c / r for c, r in zip(car_rates, crc_rates, strict=True))
    print(f"{SIZE} bytes, job {JOB}: raw TCP median {raw:.2f} GiB/s, sidecar median "
          f"{car:.2f} GiB/s (checksummed, acknowledged, into preallocated replica memory"
          f"{', encrypted' if encrypt else ''})")
    metric = "replication_throughput_ratio_vs_raw_tcp" + ("_encrypted" if encrypt else "")
    print(json.dumps({"metric": metric,
                      "value": round(ratio, 3), "target": 0.9, "better": "higher",
                      "unit": "ratio", "raw_gib_s": round(raw, 3),
                      "sidecar_gib_s": round(car, 3),
                      "raw_cpu_s": round(statistics.median(raw_cpu), 3),
                      "sidecar_cpu_s": round(statistics.median(car_cpu), 3),
                      "raw_crc32_gib_s": round(statistics.median(crc_rates), 3),
                      "raw_crc32_cpu_s": round(statistics.median(crc_cpu), 3),
                      "vs_raw_crc32": round(vs_crc, 3), "runs": RUNS}))


if __name__ == "__main__":
    main()
