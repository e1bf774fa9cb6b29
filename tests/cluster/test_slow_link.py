"""A slow link between real pods: `gemini fault slow-link` polices a node's traffic to the
rate in both directions, `gemini fault heal` gives it its full speed back, bad input is refused.

A pod on the slowed spare and one on node-1 each run PEER (below); the test asks the slowed one
to push to, or pull from, the other for a few seconds and reads back the receiver's rate.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.nodes import LocalCluster, wait_until

pytestmark = pytest.mark.cluster

PORT = 7100
RATE = "40Mbit"  # 5 MB/s each way
RATE_BYTES = 5_000_000
# The receiver's rate after its first second: nftables' bucket starts full with one second's
# worth of the rate, which the first second drains at full speed.
PEER = textwrap.dedent(f"""
    import os, socket, threading, time
    IP = os.environ["GEMINI_POD_IP"]

    def send_for(conn, seconds):
        chunk, end = b"x" * 65536, time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)

    def receive_rate(conn):
        start, total, mark = time.monotonic(), 0, None
        while data := conn.recv(1 << 20):
            total += len(data)
            if mark is None and time.monotonic() - start >= 1.0:
                mark = (time.monotonic(), total)
        if mark is None:
            return total / max(time.monotonic() - start, 1e-6)
        return (total - mark[1]) / max(time.monotonic() - mark[0], 1e-6)

    def read_all(conn):
        out = b""
        while data := conn.recv(4096):
            out += data
        return out

    def command(conn):
        out = b""
        while len(out) < 256:
            out += conn.recv(256 - len(out))
        return out.decode().split()

    def handle(conn):
        verb, *args = command(conn)
        if verb == "sink":
            conn.sendall(b"%f" % receive_rate(conn))
        elif verb == "blast":
            send_for(conn, float(args[0]))
        elif verb == "push":  # from this pod's IP, as gloo binds it
            peer = socket.create_connection((args[0], {PORT}), source_address=(IP, 0))
            peer.sendall(b"sink\\n".ljust(256))
            send_for(peer, float(args[1]))
            conn.sendall(read_all(peer))
        elif verb == "pull":  # unbound: leaves from 127.0.0.1, still the node's (its group)
            peer = socket.create_connection((args[0], {PORT}))
            peer.sendall(f"blast {{args[1]}}".encode().ljust(256))
            conn.sendall(b"%f" % receive_rate(peer))
        conn.close()

    server = socket.create_server((IP, {PORT}))
    while True:
        c, _ = server.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()
""")


def gemini_fault(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "gemini"), "fault",
                           f"--state-dir={cluster.state_dir}", *args],
                          capture_output=True, text=True, timeout=30, check=False)


def start_peer(cluster: LocalCluster, namespace: str, name: str, node: str) -> str:
    """The pod's IP once its server answers."""
    body: Any = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [
            {"name": "peer", "image": "x", "command": ["python", "-u", "-c", PEER]}]}}
    cluster.core.create_namespaced_pod(namespace, body)

    def serving() -> str | None:
        pod: Any = cluster.core.read_namespaced_pod(name, namespace)
        ip = pod.status.pod_ip if pod.status.phase == "Running" else None
        if ip is None:
            return None
        try:
            socket.create_connection((ip, PORT), timeout=0.5).close()
        except OSError:
            return None
        return str(ip)
    return str(wait_until(serving, 20, f"pod {name} serving", interval=0.2))


def rate(peer_ip: str, verb: str, other_ip: str, seconds: float) -> float:
    """Ask the peer to push to or pull from the other pod; the receiving end's bytes/s."""
    with socket.create_connection((peer_ip, PORT), timeout=30) as conn:
        conn.sendall(f"{verb} {other_ip} {seconds}".encode().ljust(256))
        conn.settimeout(seconds + 30)
        reply = b""
        while data := conn.recv(4096):
            reply += data
    return float(reply)


def test_a_slow_link_polices_both_directions_and_heal_restores_full_speed(
    local_cluster: LocalCluster, namespace: str,
) -> None:
    if os.geteuid() != 0 or not shutil.which("nft"):
        pytest.skip("slow links need root and nftables")
    spare = local_cluster.add_spare()
    slowed = start_peer(local_cluster, namespace, "slowed", spare.name)
    other = start_peer(local_cluster, namespace, "other", "node-1")

    result = gemini_fault(local_cluster, "slow-link", spare.name, "--rate", RATE, "-o", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rateBytesPerSecond"] == RATE_BYTES
    try:
        up, down = rate(slowed, "push", other, 3), rate(slowed, "pull", other, 3)
    finally:
        healed = gemini_fault(local_cluster, "heal", spare.name, "-o", "json")
    assert healed.returncode == 0, healed.stderr
    assert json.loads(healed.stdout) == {"node": spare.name, "wasPartitioned": False,
                                         "wasSlowed": True}
    print(f"slowed to {RATE_BYTES / 1e6:.1f} MB/s: up {up / 1e6:.2f}, down {down / 1e6:.2f}")
    assert 0.7 * RATE_BYTES <= up <= 1.3 * RATE_BYTES
    assert 0.7 * RATE_BYTES <= down <= 1.3 * RATE_BYTES

    full_up, full_down = rate(slowed, "push", other, 1.5), rate(slowed, "pull", other, 1.5)
    print(f"healed: up {full_up / 1e6:.0f} MB/s, down {full_down / 1e6:.0f} MB/s")
    assert min(full_up, full_down) > 4 * RATE_BYTES


def test_slow_link_refuses_an_unknown_node_and_a_rate_that_is_not_one(
    local_cluster: LocalCluster,
) -> None:
    missing = gemini_fault(local_cluster, "slow-link", "no-such-node", "--rate", "1Mi")
    assert missing.returncode == 1
    assert "no node 'no-such-node'" in missing.stderr and "node-0" in missing.stderr
    bad = gemini_fault(local_cluster, "slow-link", "node-0", "--rate", "fast")
    assert bad.returncode == 1
    assert "not a rate: 'fast'" in bad.stderr
    no_rate = gemini_fault(local_cluster, "slow-link", "node-0")
    assert no_rate.returncode == 2 and "--rate" in no_rate.stderr
