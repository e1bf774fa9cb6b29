"""Node addresses, group ids, pod IP allocation and the machine-wide claim of a cluster range."""

from __future__ import annotations

import pytest

from gemini_local import nodes
from gemini_local.nodeagent.addressing import NodeNetwork, PodIpPool


def test_each_node_has_its_own_slash_24_and_group():
    a, b = NodeNetwork(150, 0), NodeNetwork(150, 1)
    assert (a.node_ip, a.cidr) == ("127.150.1.1", "127.150.1.0/24")
    assert (b.node_ip, b.cidr) == ("127.150.2.1", "127.150.2.0/24")
    assert a.gid != b.gid != NodeNetwork(151, 0).gid
    assert a.contains("127.150.1.77") and not a.contains("127.150.2.77")
    assert a.node_ip not in a.pod_ips() and len(a.pod_ips()) == 253


def test_node_index_out_of_range_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        NodeNetwork(150, 254)


def test_pod_ip_pool_reuses_a_released_address_last():
    pool = PodIpPool(["a", "b", "c"])
    first = pool.allocate()
    pool.release(first)
    assert [pool.allocate() for _ in range(3)] == ["b", "c", "a"]
    with pytest.raises(RuntimeError, match="no free pod IP"):
        pool.allocate()


def test_two_clusters_claim_different_ranges_and_a_stale_claim_is_taken_over(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(nodes, "CLAIMS_DIR", tmp_path / "claims")
    # Claims here are not machine-wide: never clear the real ranges' leftovers.
    cleared: list[int] = []
    monkeypatch.setattr(nodes, "_clear_range", cleared.append)
    one, two = tmp_path / "one", tmp_path / "two"
    octet_one = nodes.network_octet(one)
    octet_two = nodes.network_octet(two)
    assert octet_one != octet_two
    assert nodes.network_octet(one) == octet_one  # recorded in the state dir
    # A claim whose owner directory is gone is stale and can be taken over.
    claim = tmp_path / "claims" / str(octet_two)
    claim.write_text(str(tmp_path / "deleted"))
    monkeypatch.setattr(nodes, "cluster_octet", lambda _d: octet_two)
    assert nodes.network_octet(tmp_path / "three") == octet_two
    assert cleared == [octet_one, octet_two, octet_two]  # each claim taken clears its range
    # A fresh claim of a live directory is respected even before its agents run.
    assert nodes.network_octet(tmp_path / "four") not in (octet_one, octet_two)
