"""A peer that stops answering mid-send (its node cut off) is noticed within seconds by the
kernel (TCP_USER_TIMEOUT and keepalive on every peer connection), not after the 120 s reply
timeout: the send fails, and it is tried again once the peer answers. Real sidecars on
loopback; the cut is an nftables rule dropping the peer port's packets (needs root and nft,
which `./dev` installs)."""

from __future__ import annotations

import os
import subprocess
import time
from functools import partial

import pytest

from gemini_sidecar.peer_bulk import PEER_SILENCE_S
from tests.integration.sidecar.conftest import (
    free_port,
    make_config,
    payload,
    replica_complete,
    started,
    wait_for,
    write_local,
)

pytestmark = pytest.mark.integration


def nft(script: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True)


def cut_port(table: str, port: int) -> None:
    nft(f"table inet {table} {{\n chain out {{\n  type filter hook output priority 0;\n"
        f"  tcp dport {port} drop\n  tcp sport {port} drop\n }}\n}}\n")


async def test_a_silent_peer_ends_the_send_within_seconds(tmp_path):
    table = f"gemini_test_silence_{os.getpid()}"
    ports = {0: free_port(), 1: free_port()}
    configs = (make_config(0, 2, tmp_path, ports, send_to=(1,)),
               make_config(1, 2, tmp_path, ports, hold=(0,)))
    try:
        async with started(*configs) as (a, b):
            write_local(a.cfg, 1, payload(1, 1 << 20), capacity=256 << 20)
            a.notify(1, 0.0)
            await wait_for(partial(replica_complete, b, 0, 1), what="version 1 at rank 1")
            cut_port(table, ports[1])  # the connection stays open; nothing gets through
            write_local(a.cfg, 2, bytes(200 << 20), capacity=256 << 20)
            cut_at = time.monotonic()
            a.notify(2, 0.0)
            await wait_for(lambda: bool(a.replicator.status.peers[1].last_error),
                           timeout=PEER_SILENCE_S + 20, what="the send to fail")
            took = time.monotonic() - cut_at
            assert took < PEER_SILENCE_S + 15, f"noticed after {took:.1f} s"
            assert not replica_complete(b, 0, 2)
            # Healed: the send is tried again by itself (the trainer sends no new notice while
            # it waits for the acknowledgement), and the version gets acknowledged.
            subprocess.run(["nft", "delete", "table", "inet", table], check=True)
            await wait_for(partial(replica_complete, b, 0, 2), timeout=60, what="version 2 again")
            await wait_for(lambda: a.replicator.status.acknowledged_version == 2, timeout=10,
                           what="the acknowledgement")
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
