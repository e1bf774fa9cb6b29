"""Ports for servers that start slowly (torch's TCPStore): none an outgoing connection can take."""

from __future__ import annotations

from pathlib import Path

from gemini_local.processes import free_port


def test_free_ports_are_outside_the_kernels_ephemeral_range() -> None:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(50)}
    assert not [p for p in ports if low <= p <= high]
