"""Helpers for the starvation and hostile-input tests: a sidecar process with its own limits
and file descriptor cap, raw connections that stall, and a fetch through the real client."""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from gemini_sidecar.config import PeerAddress, SidecarConfig
from gemini_sidecar.fetcher import Fetched, FetchRequest, fetch
from gemini_sidecar.metrics import make_metrics
from tests.integration.sidecar.conftest import sidecar_env

API_STALL = b"GET /inventory HTTP/1.1\r\nHost: sidecar\r\nAuthorization: Bear"  # no end
PEER_STALL = b"GMN1\x01"  # the start of a HELLO header, never finished


class LimitedSidecar:
    """`gemini sidecar` as a process with extra settings; its log goes to `log_path`."""

    def __init__(self, cfg: SidecarConfig, api_port: int, log_path: Path,
                 extra_env: Mapping[str, str] | None = None) -> None:
        self.cfg, self.api_port, self.log_path = cfg, api_port, log_path
        code = "import sys; from gemini_cli import main; sys.exit(main(['sidecar']))"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code], env=sidecar_env(cfg, api_port, extra_env or {}),
                stdout=subprocess.PIPE, stderr=log)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"sidecar did not start: {log_path.read_text()}"
        self.ready = json.loads(line)
        self.url = f"http://127.0.0.1:{api_port}"

    def limit_fds(self, spare: int) -> None:
        """Let the process open only `spare` more files than it has open now (soft and hard
        limit, so it cannot raise them again)."""
        cap = self.open_fds() + spare
        resource.prlimit(self.proc.pid, resource.RLIMIT_NOFILE, (cap, cap))

    def log(self) -> str:
        return self.log_path.read_text()

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


def ensure_fds(wanted: int) -> None:
    """Raise this process's soft file descriptor limit to `wanted` (the test opens that many)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            raise RuntimeError(f"the test needs {wanted} file descriptors; the hard limit is "
                               f"{hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def stalled(port: int, first_bytes: bytes, source: str = "127.0.0.1") -> socket.socket:
    """A connection (from `source`, a loopback address) that sends the start of a request and
    then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                    source_address=(source, 0))
    sock.sendall(first_bytes)
    return sock


def closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the other end closed (EOF or reset) within `wait_s`; data read is dropped."""
    deadline = time.monotonic() + wait_s
    poller = select.poll()  # not select(): descriptors past 1024 are fine
    poller.register(sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
    while (left := deadline - time.monotonic()) > 0:
        if not poller.poll(left * 1000):
            return False
        try:
            if not sock.recv(65536):
                return True
        except OSError:  # reset
            return True
    return False


def wait_all_closed(socks: list[socket.socket], wait_s: float) -> list[float]:
    """Seconds from now until each of `socks` was closed by the other end (inf: not within
    `wait_s`), watching them all at once."""
    start = time.monotonic()
    closed = [float("inf")] * len(socks)
    open_ = {s.fileno(): i for i, s in enumerate(socks)}
    poller = select.poll()
    for fd in open_:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while open_ and (left := start + wait_s - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            i = open_[fd]
            try:
                data = socks[i].recv(65536)
            except OSError:
                data = b""
            if not data:
                closed[i] = time.monotonic() - start
                poller.unregister(fd)
                del open_[fd]
    return closed


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


async def fetch_bytes(cfg: SidecarConfig, rank: int, version: int, holder: PeerAddress
                      ) -> tuple[Fetched, bytes]:
    """Fetch `rank` from `holder` with the sidecar's real client, into fresh memory."""
    got: list[bytearray] = []

    def allocate(version: int, length: int, crc: int) -> memoryview:
        got.append(bytearray(length))
        return memoryview(got[-1])

    req = FetchRequest(cfg.job, cfg.auth_token, cfg.max_frame_bytes, rank, version, [holder],
                       chunk_bytes=cfg.chunk_bytes)
    result = await fetch(req, allocate, make_metrics(cfg.namespace, cfg.job, 99))
    return result, bytes(got[-1])
