"""The operator's client of the sidecars' control API (HTTP, job token as a Bearer token).

What the operator asks of sidecars and launchers: a sidecar's placement (POST /peers), and
any JSON call to one rank or to all of them in parallel. Addresses are pod IPs, which work
with or without cluster DNS.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

TIMEOUT_SECONDS = 5.0
# POST /peers is answered at once by a live sidecar; a silent one (a cut-off node) must not
# hold up the reconcile that delivers to the others for long. Delivery is retried.
DELIVERY_TIMEOUT_SECONDS = 3.0
# Recovery plans with the inventories that answer within this; a silent sidecar's copies are
# left out rather than waited for (its node may be cut off).
INVENTORY_TIMEOUT_SECONDS = 2.0


class SidecarError(RuntimeError):
    """A sidecar did not take the request; the message names the rank and the reason."""


class DeliveryError(SidecarError):
    """Some sidecars did not take their placement: how many of how many, and why."""

    def __init__(self, errors: list[str], total: int) -> None:
        super().__init__(_summary(errors))
        self.failed, self.total = len(errors), total


def _summary(errors: Sequence[str]) -> str:
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(errors[:3]) + more


@dataclass(frozen=True)
class SidecarAddress:
    rank: int
    ip: str
    api_port: int
    peer_port: int


def placement_bodies(
    placement: Mapping[str, Any], addresses: Mapping[int, SidecarAddress],
) -> dict[int, dict[str, Any]]:
    """Each rank's POST /peers body from a status.placement document."""
    holders = {int(r): [int(h) for h in hs] for r, hs in placement["holders"].items()}
    held_by: dict[int, list[int]] = {r: [] for r in holders}
    for rank, rank_holders in holders.items():
        for peer in rank_holders[1:]:
            held_by[peer].append(rank)
    bodies = {}
    for rank in holders:
        send_to, hold = holders[rank][1:], sorted(held_by[rank])
        peers = {str(r): f"{addresses[r].ip}:{addresses[r].peer_port}"
                 for r in sorted(set(send_to) | set(hold))}
        bodies[rank] = {"peers": peers, "hold_ranks": hold, "send_to": send_to}
    return bodies


def deliver_placement(
    placement: Mapping[str, Any], addresses: Mapping[int, SidecarAddress], token: str,
    timeout: float = TIMEOUT_SECONDS,
) -> None:
    """POST every rank's part of `placement` to its sidecar, in parallel; raise DeliveryError
    on any refusal (after trying every rank)."""
    bodies = placement_bodies(placement, addresses)
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(bodies)))) as pool:
        errors = [e for e in pool.map(
            lambda r: _post(addresses[r], "/peers", bodies[r], token, timeout),
            sorted(bodies)) if e]
    if errors:
        raise DeliveryError(errors, len(bodies))


def _post(address: SidecarAddress, path: str, body: Mapping[str, Any], token: str,
          timeout: float = TIMEOUT_SECONDS) -> str | None:
    request = urllib.request.Request(
        f"http://{address.ip}:{address.api_port}{path}", data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return None
    except urllib.error.HTTPError as err:
        return f"rank {address.rank}: {path} answered {err.code} {err.read()[:200]!r}"
    except OSError as err:
        return f"rank {address.rank}: {path} unreachable ({err})"


def call(
    ip: str, port: int, path: str, token: str, body: Mapping[str, Any] | None = None,
    timeout: float = TIMEOUT_SECONDS,
) -> dict[str, Any]:
    """One JSON request to a sidecar or launcher (GET without a body, POST with one); the
    answer's JSON object. Raises SidecarError naming the address and what it answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{ip}:{port}{path}", data=data, method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        raise SidecarError(f"{ip}:{port}{path} answered {err.code} {err.read()[:300]!r}") from err
    except (OSError, ValueError) as err:
        raise SidecarError(f"{ip}:{port}{path} unreachable ({err})") from err
    return answer if isinstance(answer, dict) else {"answer": answer}


def call_all(
    targets: Mapping[int, tuple[str, int]], path: str, token: str,
    bodies: Mapping[int, Mapping[str, Any] | None], timeout: float = TIMEOUT_SECONDS,
) -> dict[int, dict[str, Any]]:
    """`call` for every rank in parallel; raise one SidecarError naming every failure."""
    results, errors = call_each(targets, path, token, bodies, timeout)
    if errors:
        raise SidecarError(_summary(errors))
    return results


def call_each(
    targets: Mapping[int, tuple[str, int]], path: str, token: str,
    bodies: Mapping[int, Mapping[str, Any] | None], timeout: float = TIMEOUT_SECONDS,
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """`call` for every rank in parallel: the answers, and the failures in words."""
    ranks = sorted(targets)
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []

    def one(rank: int) -> None:
        ip, port = targets[rank]
        try:
            results[rank] = call(ip, port, path, token, bodies.get(rank), timeout)
        except SidecarError as err:
            errors.append(f"rank {rank}: {err}")

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(ranks)))) as pool:
        list(pool.map(one, ranks))
    return results, sorted(errors)


def persist_and_commit(targets: Mapping[int, tuple[str, int]], token: str, version: int,
                       timeout: float) -> None:
    """Every rank's sidecar uploads `version` of its shard, then the lowest rank's commits
    it (the commit marker makes the step visible only once every shard is in S3)."""
    call_all(targets, "/persist", token, {r: {"version": version} for r in targets}, timeout)
    ip, port = targets[min(targets)]
    call(ip, port, "/commit", token, {"version": version}, timeout)
