"""Helpers for sidecar tests: configs for sidecars on loopback and trainer-side shm writes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np

from gemini.slots.layout import SlotInfo, shard_path
from gemini.slots.shard import ShardSlots
from gemini_local.processes import free_port as free_port  # the tests here import it
from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import PeerAddress, SidecarConfig, make_placement

JOB = "job-a"
TOKEN = b"job-a-secret-token-0123456789"


def make_config(
    rank: int,
    world: int,
    shm_dir: Path,
    ports: dict[int, int],
    hold: tuple[int, ...] = (),
    send_to: tuple[int, ...] = (),
    budget: int = 1 << 30,
    job: str = JOB,
    token: bytes = TOKEN,
    **extra: object,
) -> SidecarConfig:
    peers = {r: PeerAddress("127.0.0.1", p) for r, p in ports.items()}
    placement = make_placement(peers, hold, send_to, rank, world)
    fields: dict[str, object] = dict(
        job=job, rank=rank, world_size=world, bind_host="127.0.0.1", peer_port=ports[rank],
        api_port=0, placement=placement, memory_budget_bytes=budget, auth_token=token,
        shm_dir=shm_dir / f"rank{rank}", traffic_mode="immediate", chunk_bytes=1 << 20,
    )
    fields.update(extra)
    os.makedirs(shm_dir / f"rank{rank}", exist_ok=True)
    return SidecarConfig(**fields)  # type: ignore[arg-type]


def sidecar_env(cfg: SidecarConfig, api_port: int, extra: Mapping[str, str]) -> dict[str, str]:
    peers = ",".join(f"{r}={a}" for r, a in cfg.placement.peers.items())
    env = dict(os.environ)
    env.update({
        "GEMINI_JOB": cfg.job, "GEMINI_RANK": str(cfg.rank),
        "GEMINI_WORLD_SIZE": str(cfg.world_size), "GEMINI_AUTH_TOKEN": cfg.auth_token.decode(),
        "GEMINI_MEMORY_BUDGET_BYTES": str(cfg.memory_budget_bytes), "GEMINI_PEERS": peers,
        "GEMINI_HOLD_RANKS": ",".join(map(str, cfg.placement.hold_ranks)),
        "GEMINI_SEND_TO": ",".join(map(str, cfg.placement.send_to)),
        "GEMINI_POD_IP": "127.0.0.1", "GEMINI_SIDECAR_PORT": str(cfg.peer_port),
        "GEMINI_SIDECAR_API_PORT": str(api_port), "GEMINI_SHM_DIR": str(cfg.shm_dir),
        "GEMINI_TRAFFIC_MODE": cfg.traffic_mode, "GEMINI_CHUNK_BYTES": str(cfg.chunk_bytes),
    })
    env.update(extra)
    return env


def payload(version: int, size: int) -> bytes:
    rng = np.random.default_rng(version)
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def write_local(cfg: SidecarConfig, version: int, data: bytes, capacity: int = 0) -> SlotInfo:
    """What the trainer does: commit `data` as `version` into this rank's slot file."""
    path = shard_path(cfg.rank, cfg.shm_dir, cfg.job)
    with ShardSlots(path, capacity or max(len(data), 1 << 20), rank=cfg.rank) as slots:
        view = slots.begin(version, len(data))
        view[:] = data
        view.release()
        return slots.commit(version)


def read_local(cfg: SidecarConfig, version: int) -> bytes:
    with ShardSlots(shard_path(cfg.rank, cfg.shm_dir, cfg.job)) as slots:
        view = slots.read(version, verify=True)
        out = bytes(view)
        view.release()
        return out


async def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.02)


class SidecarProcess:
    """`gemini sidecar` as a real process, configured through its environment."""

    def __init__(self, cfg: SidecarConfig, api_port: int,
                 extra_env: Mapping[str, str] | None = None) -> None:
        import subprocess
        import sys

        self.cfg = cfg
        self.api_port = api_port
        env = sidecar_env(cfg, api_port, extra_env or {})
        code = "import sys; from gemini_cli import main; sys.exit(main(['sidecar']))"
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"sidecar did not start: {self.proc.stderr.read() if self.proc.stderr else ''}"
        self.url = f"http://127.0.0.1:{api_port}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


def replica_complete(sidecar: Sidecar, rank: int, version: int) -> bool:
    """Whether `sidecar` holds `version` of `rank`'s shard, complete."""
    return any(r.rank == rank and r.version == version and r.complete
               for r in sidecar.store.inventory())


async def relay(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                forward: Callable[[], bool] = lambda: True,
                before: Callable[[int], Awaitable[None]] | None = None) -> None:
    """Copy `src` to `dst` until either end closes (bytes read while `forward()` is false are
    swallowed: a path that went dark; `before(n)` is awaited before n bytes are passed on: a
    paced link), then close `dst`."""
    try:
        while data := await src.read(1 << 16):
            if forward():
                if before is not None:
                    await before(len(data))
                dst.write(data)
                await dst.drain()
    except ConnectionError:
        pass
    finally:
        dst.close()


@asynccontextmanager
async def started(*configs: SidecarConfig) -> AsyncIterator[tuple[Sidecar, ...]]:
    """Sidecars in this process, started in order and stopped at the end."""
    sidecars: list[Sidecar] = []
    try:
        for cfg in configs:
            sidecars.append(Sidecar(cfg))
            await sidecars[-1].start()
        yield tuple(sidecars)
    finally:
        for sidecar in reversed(sidecars):
            await asyncio.wait_for(sidecar.stop(), 30)
