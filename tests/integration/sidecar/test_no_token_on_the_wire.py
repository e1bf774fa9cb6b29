"""Issue 45, item 3: no token crosses the network. Every frame on the loopback interface is
recorded (a raw packet socket, as an on-path observer would) while the operator drives two
sidecars (placement, inventory, the inventory relay between them) and the trainer notifies its
own: neither the operator's control token nor the job token is in the recording, while the
calls themselves are (the recording is not empty)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gemini.control import auth
from gemini.control.client import ControlClient
from gemini.control.inventory import InventoriesRequest
from gemini.control.messages import NotifyRequest
from gemini.control.signing import CONTROL_PUBLIC_KEY_ENV, control_public_key, public_key_setting
from tests.integration.sidecar.conftest import TOKEN, free_port, make_config, started

pytestmark = pytest.mark.integration
CONTROL = "control-token-on-the-wire-0123456789"
ETH_P_ALL = 0x0003


@contextmanager
def recording(interface: str = "lo") -> Iterator[bytearray]:
    """Every frame seen on `interface` while the block runs (root: a raw packet socket)."""
    assert os.geteuid() == 0, "recording the wire needs root (CI runs as root)"
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((interface, 0))
    sock.settimeout(0.05)
    frames, done = bytearray(), threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                frames.extend(sock.recv(1 << 16))
            except TimeoutError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield frames
    finally:
        time.sleep(0.2)  # the last answers' frames
        done.set()
        reader.join(5)
        sock.close()


async def test_neither_token_crosses_the_wire(tmp_path):
    key = public_key_setting({CONTROL_PUBLIC_KEY_ENV: control_public_key(CONTROL)})
    ports = {0: free_port(), 1: free_port()}
    cfgs = [make_config(r, 2, tmp_path, ports, control_public_key=key) for r in (0, 1)]
    async with started(*cfgs) as cars:
        operator = [ControlClient("127.0.0.1", c.api_port, auth.Credentials(CONTROL), timeout=10)
                    for c in cars]
        trainer = ControlClient("127.0.0.1", cars[0].api_port, TOKEN.decode(), timeout=10)

        def calls() -> None:
            for client in operator:
                client.inventory()
                client.peers(client.inventory().placement)
            relayed = operator[0].inventories(InventoriesRequest(
                {1: f"127.0.0.1:{cars[1].api_port}"}, 5.0))
            assert sorted(relayed.inventories) == [0, 1], relayed.failed
            trainer.notify(NotifyRequest(0))

        with recording() as wire:
            await asyncio.to_thread(calls)
    seen = bytes(wire)
    assert b"Gemini-Operator " in seen and b"Gemini-Job " in seen and b"/inventories" in seen
    assert CONTROL.encode() not in seen
    assert TOKEN not in seen
