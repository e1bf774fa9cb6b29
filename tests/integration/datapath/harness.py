"""One 'pod' per rank on loopback: a real `gemini sidecar` process beside a trainer process.

``Job`` starts the sidecars (placement from gemini.domain.placement.mixed_placement, each
rank's shm in a directory of its own, as an emptyDir per pod would be), launches trainer runs
(examples/train_gpt_zero3.py through tests/fixtures/trainers.TrainingRun) wired to them, and
drives the sidecars' HTTP API as the operator would. ``CorruptingProxy`` sits in front of a
holder and flips one bit in the payload of the first DATA frame it forwards.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemini.domain.placement import mixed_placement
from gemini.slots.layout import SlotInfo, shard_path
from gemini.slots.shard import ShardSlots
from gemini_sidecar.peer_frames import CHALLENGE_BYTES, HEADER_BYTES, FrameType, wire_payload_bytes
from tests.fixtures.trainers import TrainingRun, free_port

JOB = "proof"
TOKEN = "proof-job-token-0123456789abcdef"
SIDECAR_CODE = "import sys; from gemini_cli import main; sys.exit(main(['sidecar']))"


@dataclass
class SidecarProc:
    rank: int
    proc: subprocess.Popen[str]
    log: Path

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(20)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Job:
    """World of ``world`` ranks with m = ``replicas``; ``s3_env`` configures S3 (may be empty)."""

    root: Path
    world: int
    replicas: int = 2
    s3_env: Mapping[str, str] = field(default_factory=dict)
    mode: str = "immediate"
    peer_ports: dict[int, int] = field(default_factory=dict)
    api_ports: dict[int, int] = field(default_factory=dict)
    sidecars: dict[int, SidecarProc] = field(default_factory=dict)
    runs: list[TrainingRun] = field(default_factory=list)
    launches: int = 0

    def __post_init__(self) -> None:
        self.placement = mixed_placement(self.world, self.replicas)
        for r in range(self.world):
            self.peer_ports[r], self.api_ports[r] = free_port(), free_port()

    # -- pods ----------------------------------------------------------------------------
    def shm(self, rank: int) -> Path:
        return self.root / "shm" / f"rank{rank}"

    def slot_file(self, rank: int) -> Path:
        return shard_path(rank, self.shm(rank), JOB)

    def peer_address(self, rank: int) -> str:
        return f"127.0.0.1:{self.peer_ports[rank]}"

    def start_sidecar(self, rank: int) -> SidecarProc:
        self.shm(rank).mkdir(parents=True, exist_ok=True)
        peers = ",".join(f"{r}={self.peer_address(r)}" for r in range(self.world))
        env = dict(os.environ)
        env.update(self.s3_env)
        env.update({
            "GEMINI_JOB": JOB, "GEMINI_RANK": str(rank), "GEMINI_WORLD_SIZE": str(self.world),
            "GEMINI_AUTH_TOKEN": TOKEN, "GEMINI_MEMORY_BUDGET_BYTES": str(1 << 30),
            "GEMINI_PEERS": peers,
            "GEMINI_HOLD_RANKS": ",".join(map(str, self.placement.receives_from(rank))),
            "GEMINI_SEND_TO": ",".join(map(str, self.placement.sends_to(rank))),
            "GEMINI_POD_IP": "127.0.0.1", "GEMINI_SIDECAR_PORT": str(self.peer_ports[rank]),
            "GEMINI_SIDECAR_API_PORT": str(self.api_ports[rank]),
            "GEMINI_SHM_DIR": str(self.shm(rank)), "GEMINI_TRAFFIC_MODE": self.mode,
            "GEMINI_CHUNK_BYTES": str(16 << 10), "OMP_NUM_THREADS": "1",
        })
        self.launches += 1
        log = self.root / f"sidecar{rank}-{self.launches}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", SIDECAR_CODE], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"sidecar {rank} did not start:\n{log.read_text()}"
        car = SidecarProc(rank, proc, log)
        self.sidecars[rank] = car
        return car

    def start_sidecars(self) -> None:
        for r in range(self.world):
            self.start_sidecar(r)

    def lose_pod_memory(self, rank: int) -> None:
        """The pod is gone: its sidecar (replicas in its memory) and its shm emptyDir."""
        self.sidecars.pop(rank).kill()
        shutil.rmtree(self.shm(rank))

    def train(self, name: str, args: list[str], **env: str) -> TrainingRun:
        per_rank = {
            r: {"GEMINI_SHM_DIR": str(self.shm(r)),
                "GEMINI_SIDECAR_URL": f"http://127.0.0.1:{self.api_ports[r]}"}
            for r in range(self.world)
        }
        common = {"GEMINI_JOB": JOB, "GEMINI_AUTH_TOKEN": TOKEN, **env}
        run = TrainingRun(self.root / name, self.world, args, env=common, per_rank_env=per_rank)
        self.runs.append(run)
        return run.start()

    def close(self) -> None:
        for run in self.runs:
            run.kill()
        for car in self.sidecars.values():
            car.kill()

    # -- the control API -----------------------------------------------------------------
    def call(self, rank: int, method: str, path: str, body: Any = None,
             timeout: float = 120) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.api_ports[rank]}{path}", data=data, method=method,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def ok(self, rank: int, method: str, path: str, body: Any = None) -> Any:
        status, doc = self.call(rank, method, path, body)
        assert status == 200, f"{method} {path} on rank {rank}: {status} {doc}"
        return doc

    def inventory(self, rank: int) -> dict[str, Any]:
        doc: dict[str, Any] = self.ok(rank, "GET", "/inventory")
        return doc

    def local_versions(self, rank: int) -> set[int]:
        return {e["version"] for e in self.inventory(rank)["local"] if e["complete"]}

    def replica_versions(self, holder: int, rank: int) -> set[int]:
        return {e["version"] for e in self.inventory(holder)["replicas"]
                if e["rank"] == rank and e["complete"]}

    def persist_and_commit(self, deadline_s: float = 120) -> int:
        """Persist one version every rank has (the newest such) and commit it; retried when a
        rank overwrote that version during its upload (training keeps going meanwhile)."""
        deadline = time.monotonic() + deadline_s
        while True:
            common = set.intersection(*(self.local_versions(r) for r in range(self.world)))
            if common:
                version = max(common)
                results = [self.call(r, "POST", "/persist", {"version": version})
                           for r in range(self.world)]
                if all(status == 200 for status, _ in results):
                    self.ok(0, "POST", "/commit", {"version": version})
                    return version
            assert time.monotonic() < deadline, f"could not persist a common version: {common}"
            time.sleep(0.05)


def losses_match(run: TrainingRun, reference: TrainingRun, rank: int) -> dict[int, str]:
    """The steps ``run`` printed for ``rank``, asserting each equals the reference bit for bit."""
    got = run.losses(rank)
    want = reference.losses(rank)
    assert got, f"rank {rank} printed no steps:\n{run.tail()}"
    diverged = {s: (got[s], want.get(s)) for s in got if got[s] != want.get(s)}
    assert not diverged, f"rank {rank} diverged from the uninterrupted run: {diverged}"
    return got


def half_write(path: Path, version: int) -> SlotInfo:
    """Leave ``version`` half-written in the free slot, as a trainer killed mid-copy would."""
    with ShardSlots(path) as slots:
        newest = slots.latest_complete()
        assert newest is not None
        view = slots.begin(version, newest.payload_len)
        view[: newest.payload_len // 2] = b"\x5a" * (newest.payload_len // 2)
        view.release()
        # no commit: the slot's header says "writing"; close drops the writer lock
        return slots.slot_info()[slots.target_slot()]


class CorruptingProxy:
    """TCP forwarder to ``target``; flips one bit in the middle of the first DATA payload that
    flows back (corruption on the path, after the sender computed its checksum)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.flipped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._corrupt, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def _read(self, src: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = src.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed")
            buf += got
        return bytes(buf)

    def _corrupt(self, src: socket.socket, dst: socket.socket) -> None:
        """Parse server->client frames (challenge, then header + payload) to hit payload only."""
        try:
            dst.sendall(self._read(src, CHALLENGE_BYTES))
            while True:
                head = self._read(src, HEADER_BYTES)
                ftype = head[4]
                length = struct.unpack_from(">Q", head, 4 + 1 + 1 + 2 + 4 + 8 + 8)[0]
                payload = bytearray(self._read(src, wire_payload_bytes(length)))
                if ftype == FrameType.DATA and length and not self.flipped:
                    payload[length // 2] ^= 0x10
                    self.flipped += 1
                dst.sendall(head + payload)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()
