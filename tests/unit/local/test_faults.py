"""Slow links (nft mocked): the rate parser, the nftables rules, the table per node, the CLI."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from gemini_cli import main
from gemini_local import faults, nodes
from gemini_local.nodeagent.config import AgentConfig, NodeSpec


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("500k", 500_000),
        ("500K", 500_000),
        ("10Mi", 10 * 2**20),
        ("2G", 2 * 10**9),
        ("1.5MB", 1_500_000),
        ("100Mbit", 12_500_000),
        ("1Gbit", 125_000_000),
        ("64Kibit", 8 * 1024),
        ("1000", 1000),
        ("10Mi/s", 10 * 2**20),
        (" 1Gbit ", 125_000_000),
    ],
)
def test_rates_read_as_bytes_per_second(text: str, rate: int) -> None:
    assert faults.parse_rate(text) == rate


@pytest.mark.parametrize("text", ["fast", "", "10 Mbit", "-5M", "10Mb", "1Gbps", "Mi", "1e6",
                                  "10mi"])
def test_a_rate_that_is_not_a_quantity_is_refused_with_examples(text: str) -> None:
    with pytest.raises(faults.FaultError, match=r"not a rate.*500k, 10Mi.*100Mbit"):
        faults.parse_rate(text)


def test_a_rate_below_one_byte_per_second_is_refused() -> None:
    with pytest.raises(faults.FaultError, match="below one byte per second"):
        faults.parse_rate("4bit")
    with pytest.raises(faults.FaultError, match="below one byte"):
        faults.parse_rate("0")


def test_the_rules_leave_the_node_inside_alone_and_police_each_direction_once() -> None:
    chains = faults.slow_link_rules("127.150.3.0/24", 238_403, 1_000_000)
    output = chains["output"]
    # Every packet meets at most one policer: the sorting rules end in accept or goto.
    sorting = output[2:]
    assert all(rule.endswith((" accept", " goto up", " goto down")) for rule in sorting)
    inside = output.index("ip saddr 127.150.3.0/24 ip daddr 127.150.3.0/24 accept")
    assert inside < output.index("ip saddr 127.150.3.0/24 goto up")
    assert output[1] == "meta skgid 238403 ct direction original ct mark set 238403"
    for direction in ("up", "down"):
        (rule,) = chains[direction]
        assert rule.startswith("limit rate over 1000000 bytes/second burst 65536 bytes")
        assert rule.endswith(" drop")


@pytest.fixture
def one_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """A state dir with node-0 (index 2 of cluster 150), root and nft faked; the nft calls."""
    folder = nodes.node_dir(tmp_path, "node-0")
    folder.mkdir(parents=True)
    config = AgentConfig(
        spec=NodeSpec("node-0", zone="z", rack="r", index=2), state_dir=str(tmp_path),
        node_dir=str(folder), kubeconfig="", client_cert="", client_key="", serving_cert="",
        serving_key="", ca_cert="", node_ip="127.150.3.1", cidr="127.150.3.0/24", gid=238_403,
        venv_bin="", shm_dir="")
    config.save(folder / "agent.json")
    assert asdict(nodes.node_config(tmp_path, "node-0")) == asdict(config)
    calls: list[tuple[str, ...]] = []
    tables: set[str] = set()

    def fake_nft(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        calls.append((*args, stdin or ""))
        verb, name = args[0], args[-1]
        found = name in tables
        if verb == "-f":
            tables.add(stdin.split()[2] if stdin else "")
        elif verb == "delete":
            tables.discard(name)
        return subprocess.CompletedProcess(args, 0 if found or verb == "-f" else 1, "", "")

    monkeypatch.setattr(faults, "_nft", fake_nft)
    monkeypatch.setattr("gemini_local.faults.shutil.which", lambda _name: "/usr/sbin/nft")
    monkeypatch.setattr("gemini_local.faults.os.geteuid", lambda: 0)
    return calls


def test_a_slow_link_is_a_table_of_its_own_that_heal_removes_with_a_partition(
    one_node: list[tuple[str, ...]], tmp_path: Path,
) -> None:
    faults.slow_link(tmp_path, "node-0", 1_000_000)
    script = one_node[-1][-1]
    assert script.startswith("table inet gemini_150_2_slow {")
    assert "chain up {" in script and "chain down {" in script
    assert faults.is_slowed(tmp_path, "node-0")
    assert not faults.is_partitioned(tmp_path, "node-0")
    faults.partition_node(tmp_path, "node-0")
    assert faults.is_partitioned(tmp_path, "node-0") and faults.is_slowed(tmp_path, "node-0")
    assert faults.heal_node(tmp_path, "node-0", missing_ok=False)
    assert not faults.is_partitioned(tmp_path, "node-0")
    assert not faults.is_slowed(tmp_path, "node-0")
    with pytest.raises(faults.FaultError, match="neither partitioned nor slowed"):
        faults.heal_node(tmp_path, "node-0", missing_ok=False)


def test_slowing_again_replaces_the_rate(one_node: list[tuple[str, ...]], tmp_path: Path) -> None:
    faults.slow_link(tmp_path, "node-0", 1_000_000)
    faults.slow_link(tmp_path, "node-0", 2_000_000)
    assert "over 2000000 bytes/second" in one_node[-1][-1]
    assert ("delete", "table", "inet", "gemini_150_2_slow", "") in one_node


def test_an_unknown_node_or_a_rate_below_a_byte_is_refused(
    one_node: list[tuple[str, ...]], tmp_path: Path,
) -> None:
    with pytest.raises(nodes.NodeAgentError, match=r"no node 'node-9'.*known: node-0"):
        faults.slow_link(tmp_path, "node-9", 1_000_000)
    with pytest.raises(faults.FaultError, match="at least 1 byte/s"):
        faults.slow_link(tmp_path, "node-0", 0)
    assert one_node == []


def test_the_cli_slows_heals_and_names_what_it_lifted(
    one_node: list[tuple[str, ...]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fault = ["fault", f"--state-dir={tmp_path}"]
    assert main([*fault, "slow-link", "node-0", "--rate", "100Mbit", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"node": "node-0",
                                                   "rateBytesPerSecond": 12_500_000}
    assert main([*fault, "heal", "node-0"]) == 0
    assert capsys.readouterr().out.strip() == "node node-0 back to full speed"
    assert main([*fault, "heal", "node-0", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"node": "node-0", "wasPartitioned": False,
                                                   "wasSlowed": False}


@pytest.mark.parametrize(("node", "rate", "message"), [
    ("node-9", "1Mi", "no node 'node-9' in"),
    ("node-9", "1Mi", "(known: node-0)"),
    ("node-0", "lots", "not a rate: 'lots'"),
])
def test_the_cli_refuses_an_unknown_node_or_a_bad_rate(
    one_node: list[tuple[str, ...]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    node: str, rate: str, message: str,
) -> None:
    assert main(["fault", f"--state-dir={tmp_path}", "slow-link", node, "--rate", rate]) == 1
    assert message in capsys.readouterr().err
    assert one_node == []
