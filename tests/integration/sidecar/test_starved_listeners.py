"""Servers that cannot be starved (issue 14, item 1): a sidecar out of file descriptors keeps
accepting once some are free again, stalled connections are closed at the header timeout
while fetches go on, connections over the limits are refused (and logged once), and /healthz
answers 503 when the peer listener is dead. Real sidecar processes and in-process servers on
loopback, real sockets."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import aiohttp
import pytest

from gemini_sidecar.config import PeerAddress, ServerLimits
from gemini_sidecar.peer_frames import CHALLENGE_BYTES
from tests.integration.sidecar.conftest import (
    TOKEN,
    free_port,
    make_config,
    payload,
    started,
    wait_for,
    write_local,
)
from tests.integration.sidecar.hostile import (
    API_STALL,
    PEER_STALL,
    LimitedSidecar,
    close_all,
    closed_by_peer,
    ensure_fds,
    fetch_bytes,
    stalled,
    wait_all_closed,
)

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {TOKEN.decode()}"}
SIZE = (1 << 20) + 24
VERSION = 3
NO_CAPS = {"GEMINI_MAX_CONNECTIONS": "5000", "GEMINI_MAX_CONNECTIONS_PER_HOST": "5000"}


def _challenged(sock: socket.socket, wait_s: float) -> bool:
    """Whether the peer server accepted `sock` and sent its handshake challenge."""
    sock.settimeout(wait_s)
    try:
        return len(sock.recv(CHALLENGE_BYTES, socket.MSG_WAITALL)) == CHALLENGE_BYTES
    except OSError:
        return False


def _exhaust(port: int, most: int) -> list[socket.socket]:
    """Open connections to the peer port until the server no longer answers one (it is out
    of file descriptors); returns them all, still open."""
    socks = []
    for _ in range(most):
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        if not _challenged(socks[-1], 1.5):
            return socks
    raise AssertionError(f"{most} connections and the server still accepts")


async def test_a_peer_fetch_succeeds_once_file_descriptors_are_free_after_emfile(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    cfg = make_config(0, 2, tmp_path, ports, hold=(1,))
    data = payload(VERSION, SIZE)
    write_local(cfg, VERSION, data)
    # 60 s header timeout: the held connections stay until the test closes them
    holder = LimitedSidecar(cfg, free_port(), tmp_path / "holder.log",
                            dict(NO_CAPS, GEMINI_HEADER_TIMEOUT_S="60"))
    try:
        holder.limit_fds(spare=12)  # six peer connections (two descriptors each)
        socks = await asyncio.to_thread(_exhaust, ports[0], 40)
        assert len(socks) == 7  # the seventh found no descriptor left
        await asyncio.sleep(0.5)  # the server tries again meanwhile, and fails
        close_all(socks)
        started_at = time.monotonic()
        got, fetched = await asyncio.wait_for(
            fetch_bytes(cfg, 0, VERSION, PeerAddress("127.0.0.1", ports[0])), 20)
        assert (got.version, fetched) == (VERSION, data)
        assert time.monotonic() - started_at < 5
        async with aiohttp.ClientSession() as http, http.get(holder.url + "/healthz") as resp:
            assert resp.status == 200
            assert (await resp.json())["listeners"]["peer"]["state"] == "accepting"
    finally:
        holder.stop()
    log = holder.log()
    assert log.count("peer server: cannot accept connections ([Errno 24] Too many open "
                     "files)") == 1, log  # logged once, however often it was retried
    assert "peer server: accepting again after" in log


async def test_a_thousand_stalled_requests_close_at_the_header_timeout_while_fetches_go_on(
        tmp_path):
    ensure_fds(4096)
    ports = {0: free_port(), 1: free_port()}
    victim_cfg = make_config(0, 2, tmp_path, ports, hold=(1,))
    victim_data = payload(VERSION, SIZE)
    write_local(victim_cfg, VERSION, victim_data)
    victim = LimitedSidecar(victim_cfg, free_port(), tmp_path / "victim.log",
                            dict(NO_CAPS, GEMINI_HEADER_TIMEOUT_S="3"))
    api_port = victim.api_port
    other_data = payload(VERSION + 1, SIZE)
    try:
        async with started(make_config(1, 2, tmp_path, ports, hold=(0,))) as (other,):
            write_local(other.cfg, VERSION + 1, other_data)
            api_socks = await asyncio.to_thread(
                lambda: [stalled(api_port, API_STALL) for _ in range(1000)])
            peer_socks = await asyncio.to_thread(
                lambda: [stalled(ports[0], PEER_STALL) for _ in range(1000)])
            waiting = asyncio.create_task(asyncio.to_thread(
                wait_all_closed, api_socks + peer_socks, 15))
            # meanwhile: a fetch from the victim's peer server, and its API fetching a replica
            got, fetched = await asyncio.wait_for(
                fetch_bytes(victim_cfg, 0, VERSION, PeerAddress("127.0.0.1", ports[0])), 3)
            assert (got.version, fetched) == (VERSION, victim_data)
            async with aiohttp.ClientSession() as http:
                async with http.post(victim.url + "/fetch", json={"rank": 1}, headers=AUTH,
                                     timeout=aiohttp.ClientTimeout(total=3)) as resp:
                    assert resp.status == 200, await resp.text()
                async with http.get(victim.url + "/healthz") as resp:
                    health_status, health = resp.status, await resp.json()
            closed = await waiting
            close_all(api_socks + peer_socks)
        late = [t for t in closed if t == float("inf")]
        assert not late, f"{len(late)} stalled connections still open after 15 s"
        # each closed within the header timeout (3 s) after the last opened, plus slack
        assert max(closed) < 3 + 3, max(closed)
        assert health_status == 200, health
        assert health["listeners"]["peer"]["state"] == "accepting"
    finally:
        victim.stop()
    log = victim.log()
    assert "no handshake within 3 s (GEMINI_HEADER_TIMEOUT_S)" in log
    assert "GEMINI_MAX_CONNECTIONS" not in log  # the timeout closed them, not the limits


def _listening_socket(port: int) -> socket.socket:
    """A duplicate of this process's socket listening on `port` (found by its descriptor)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and sock.getsockname()[1] == port):
                return sock
        except OSError:
            pass
        sock.close()
    raise AssertionError(f"no socket listening on {port}")


async def test_healthz_answers_503_once_the_peer_listener_is_dead(tmp_path):
    ports = {0: free_port(), 1: free_port()}
    async with started(make_config(0, 2, tmp_path, ports)) as (car,):
        url = f"http://127.0.0.1:{car.api_port}/healthz"
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as resp:
                assert resp.status == 200
                assert (await resp.json())["listeners"]["peer"]["state"] == "accepting"
            with _listening_socket(car.peer_port) as listener:
                listener.shutdown(socket.SHUT_RDWR)  # accept() now fails: EINVAL

            async def status() -> tuple[int, dict]:
                async with http.get(url) as resp:
                    return resp.status, await resp.json()

            for _ in range(100):
                code, body = await status()
                if code != 200:
                    break
                await asyncio.sleep(0.05)
            assert code == 503, body
            assert body["status"] == "failing"
            assert body["listeners"]["peer"]["state"] == "dead"
            assert "Invalid argument" in body["listeners"]["peer"]["detail"]
            assert body["listeners"]["api"]["state"] == "accepting"


async def test_connections_over_the_per_host_limit_are_refused_and_logged_once(
        tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    limits = ServerLimits(header_timeout_s=30, max_connections=100, max_connections_per_host=3)
    ports = {0: free_port(), 1: free_port()}
    async with started(make_config(0, 2, tmp_path, ports, limits=limits)) as (car,):
        for port, stall in ((car.peer_port, PEER_STALL), (car.api_port, API_STALL)):
            held = [await asyncio.to_thread(stalled, port, stall) for _ in range(3)]
            await asyncio.sleep(0.2)
            extra = [await asyncio.to_thread(stalled, port, stall) for _ in range(5)]
            assert all([await asyncio.to_thread(closed_by_peer, s, 3) for s in extra])
            assert not any([await asyncio.to_thread(closed_by_peer, s, 0.2) for s in held])
            close_all(held + extra)
        async with aiohttp.ClientSession() as http:  # a wrong token: refused, not echoed
            await wait_for(lambda: car.listener_health()["api"].connections == 0, 5)
            bad = {"Authorization": "Bearer not-the-token-but-a-guess"}
            for _ in range(3):
                async with http.get(f"http://127.0.0.1:{car.api_port}/inventory",
                                    headers=bad) as resp:
                    assert resp.status == 401
    lines = [r.getMessage() for r in caplog.records]
    over = [m for m in lines if "GEMINI_MAX_CONNECTIONS_PER_HOST=3" in m]
    # five refusals per listener: one line each, the rest folded into a count at the end
    assert [m.split(":")[0] for m in over if "refused 127.0.0.1:" in m] == [
        "peer server", "API"], lines
    assert any("refused 4 more from 127.0.0.1" in m for m in over), lines
    assert sum("without a signature that may make it" in m for m in lines) == 2, lines  # + count
    assert not any("not-the-token" in m or TOKEN.decode() in m for m in lines)


async def test_strangers_filling_the_total_limit_do_not_keep_the_jobs_own_peers_out(tmp_path):
    """Issue 45, item 4: eight addresses outside the job fill the total limit of both
    listeners; a peer of the placement (127.0.0.1 here) still fetches and calls the API, and
    the kubelet (another address) still gets its /healthz from the probe port."""
    limits = ServerLimits(header_timeout_s=30, max_connections=8, max_connections_per_host=2)
    ports = {0: free_port(), 1: free_port()}
    cfg = make_config(0, 2, tmp_path, ports, limits=limits, probe_port=0)
    data = payload(VERSION, SIZE)
    write_local(cfg, VERSION, data)
    strangers = [f"127.0.0.{i}" for i in range(2, 10)]
    async with started(cfg) as (car,):
        held = []
        for port, stall in ((car.peer_port, PEER_STALL), (car.api_port, API_STALL)):
            socks = await asyncio.to_thread(
                lambda p=port, b=stall: [stalled(p, b, src) for src in strangers for _ in "ab"])
            closed = [await asyncio.to_thread(closed_by_peer, s, 0.3) for s in socks]
            assert closed == [False] * 8 + [True] * 8  # four addresses filled the total
            held += socks
        got, fetched = await asyncio.wait_for(
            fetch_bytes(cfg, 0, VERSION, PeerAddress("127.0.0.1", ports[0])), 5)
        assert (got.version, fetched) == (VERSION, data)
        url = f"http://127.0.0.1:{car.api_port}/inventory"
        async with aiohttp.ClientSession() as http, http.get(url, headers=AUTH) as resp:
            assert resp.status == 200
        kubelet = await asyncio.to_thread(stalled, car.probe_port, b"GET /healthz HTTP/1.1\r\n"
                                          b"Host: x\r\n\r\n", "127.0.0.10")
        answer = await asyncio.to_thread(kubelet.recv, 4096)
        kubelet.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"api": {"state": "accepting"' in answer
        close_all(held)
