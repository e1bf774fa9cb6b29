"""The operator's client of the sidecars' and launchers' control API (gemini.control).

Typed calls, one per API call, each to every rank given in parallel: `inventories`,
`launcher_statuses`, `restart`, `fetch`, `fetch_replicas`, `restore`, `persist`, `commit`,
`committed_steps` (the first of a job's sidecars to answer),
and the placement (`peers_bodies`, `deliver_peers`, `deliver_placement`). The order they must
come in (placement before fetches, memory before restarts, persist before commit) is stated
in gemini.control. Addresses are pod IPs, which work with or without cluster DNS.

Every timeout here is a call's whole deadline (gemini.control.client.ControlClient): a worker that
answers a byte at a time is cut off at it, and answers are size-capped and strictly parsed,
so a job's own images can cost the operator no more than that job's calls.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import TypeVar

from gemini.control.auth import Bearer
from gemini.control.client import ControlClient, ControlError
from gemini.control.inventory import (
    MAX_RELAYED,
    InventoriesAnswer,
    InventoriesRequest,
    Inventory,
    relayed_answer_bytes,
)
from gemini.control.launcher import LauncherStatus, RestartAnswer, RestartRequest
from gemini.control.messages import Peers
from gemini.control.paths import COMMITTED_STEPS_PATH
from gemini.control.transfers import (
    CommitAnswer,
    CommitRequest,
    FetchAnswer,
    FetchReplicasAnswer,
    FetchReplicasRequest,
    FetchRequest,
    PersistAnswer,
    PersistRequest,
    RestoreAnswer,
    RestoreRequest,
    TransferRunning,
)
from gemini.domain.placement import Placement
from gemini_operator.core.observed import PodView
from gemini_operator.core.render import RenderConfig

log = logging.getLogger(__name__)
TIMEOUT_SECONDS = 5.0
# POST /peers is answered at once by a live sidecar; a silent one (a cut-off node) must not
# hold up the reconcile that delivers to the others for long. Delivery is retried.
DELIVERY_TIMEOUT_SECONDS = 3.0
# Recovery plans with the inventories that answer within this; a silent sidecar's copies are
# left out rather than waited for (its node may be cut off).
INVENTORY_TIMEOUT_SECONDS = 2.0
# A fetch or an S3 restore moves a whole shard: seconds per GiB, not a quick answer. Calls
# that wait for the end (no wait_seconds) get this deadline; a retry joins the transfer.
TRANSFER_TIMEOUT_SECONDS = 120.0
# The recovery's and the poller's transfer calls return after this at the latest with the
# progress, and ask again (joining the transfer): no call is held for the transfer's size.
TRANSFER_WAIT_SECONDS = 1.0
# From this many ranks on, inventories are asked in batches, one sidecar relaying for the
# others of its batch (POST /inventories): about sqrt(N) calls a poll instead of N.
RELAY_MIN_RANKS = 64
MIN_BATCH = 16
# A relay's own calls get this share of the poll's deadline; the rest carries its answer.
RELAY_SHARE = 0.75
# A launcher answers /restart once its running process parked: the park's grace (1 s) and,
# for one that said it is unwinding, the unwind time (8 s), then time to answer.
RESTART_TIMEOUT_SECONDS = 15.0
# Listing a job's committed steps costs the sidecar a listing and a marker read per step.
LISTING_TIMEOUT_SECONDS = 10.0

Target = tuple[str, int]  # (pod IP, port of the sidecar's API or of the launcher's)
T = TypeVar("T")
R = TypeVar("R")


class SidecarError(RuntimeError):
    """A sidecar did not take the request; the message names the rank and the reason."""


class TransfersRunning(Exception):
    """Some ranks' transfers are still under way (asked again, the calls join them)."""

    def __init__(self, running: Mapping[int, TransferRunning],
                 finished_bytes: int = 0) -> None:
        self.running = dict(running)
        self.finished_bytes = finished_bytes  # what the ranks already done moved
        super().__init__("; ".join(f"rank {r}: {t.kind} {t.words()}"
                                   for r, t in sorted(self.running.items())))

    def bytes_done(self) -> tuple[int, int | None]:
        """Bytes done and the total over every rank asked (None while some total is
        unknown); the ranks already done count whole."""
        done = self.finished_bytes + sum(t.done_bytes for t in self.running.values())
        totals = [t.total_bytes for t in self.running.values()]
        return done, None if None in totals else self.finished_bytes + sum(
            t or 0 for t in totals)


def _moved(answer: object) -> int:
    """The bytes a finished transfer moved (0 when its answer does not say)."""
    if isinstance(answer, FetchAnswer):
        return answer.length
    if isinstance(answer, (PersistAnswer, RestoreAnswer)):
        return answer.bytes
    if isinstance(answer, FetchReplicasAnswer):
        return sum(r.bytes or 0 for r in answer.replicas)
    return 0


def finished(answers: Mapping[int, T | TransferRunning]) -> dict[int, T]:
    """Every rank's answer, or TransfersRunning naming those still under way."""
    done = {r: a for r, a in answers.items() if not isinstance(a, TransferRunning)}
    running = {r: a for r, a in answers.items() if isinstance(a, TransferRunning)}
    if running:
        raise TransfersRunning(running, sum(_moved(a) for a in done.values()))
    return done


def _call_timeout(wait: float | None, timeout: float) -> float:
    """A transfer call's deadline: the wait it asked for and time to answer, else `timeout`."""
    return timeout if wait is None else wait + TIMEOUT_SECONDS


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


# -- running one call on many ranks ----------------------------------------------------------

def _in_words(rank: int, err: ControlError) -> str:
    return f"rank {rank}: {err}"  # "rank 3: 10.0.0.3:7071/inventory unreachable (...)"


def each(targets: Mapping[int, Target], token: Bearer, ask: Callable[[int, ControlClient], T],
         timeout: float = TIMEOUT_SECONDS,
         words: Callable[[int, ControlError], str] = _in_words,
         ) -> tuple[dict[int, T], list[str]]:
    """`ask(rank, client)` for every rank in parallel: the answers, and the failures in
    words, in rank order."""
    results, errors = each_by_rank(targets, token, ask, timeout, words)
    return results, [errors[r] for r in sorted(errors)]


def each_by_rank(targets: Mapping[int, Target], token: Bearer,
                 ask: Callable[[int, ControlClient], T], timeout: float = TIMEOUT_SECONDS,
                 words: Callable[[int, ControlError], str] = _in_words,
                 ) -> tuple[dict[int, T], dict[int, str]]:
    """`each`, with the failures by rank."""
    ranks = sorted(targets)
    results: dict[int, T] = {}
    errors: dict[int, str] = {}

    def one(rank: int) -> None:
        ip, port = targets[rank]
        try:
            results[rank] = ask(rank, ControlClient(ip, port, token, timeout))
        except ControlError as err:
            errors[rank] = words(rank, err)

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(ranks)))) as pool:
        list(pool.map(one, ranks))
    return results, errors


def every(targets: Mapping[int, Target], token: Bearer, ask: Callable[[int, ControlClient], T],
          timeout: float = TIMEOUT_SECONDS) -> dict[int, T]:
    """`each`, raising one SidecarError naming the failures when any rank failed."""
    results, errors = each(targets, token, ask, timeout)
    if errors:
        raise SidecarError(_summary(errors))
    return results


def _per_rank(request: R | Mapping[int, R]) -> Callable[[int], R]:
    """One request for every rank, or each rank's own."""
    if isinstance(request, Mapping):
        return lambda rank: request[rank]  # type: ignore[no-any-return]
    return lambda rank: request


def worker_ports(pods: Mapping[int, PodView], ports: RenderConfig) -> dict[int, list[Target]]:
    """Each pod's sidecar API and launcher address."""
    return {r: [(p.ip, ports.sidecar_api_port), (p.ip, ports.launcher_port)]
            for r, p in pods.items()}


def refusing(targets: Mapping[int, Sequence[Target]], timeout: float) -> set[int]:
    """The ranks none of whose ports accept a TCP connection within `timeout` (refused or
    timed out; the kernel accepts for a process that is only slow or stopped). A port this
    process could not even try (out of descriptors, memory or local ports) says nothing of the
    pod, so a rank with one is never counted: the operator's own exhaustion must not read as
    a lost node."""
    ranks = sorted(targets)

    def down(rank: int) -> bool:
        answers = [_accepts(ip, port, timeout) for ip, port in targets[rank]]
        return all(answer is False for answer in answers)

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(ranks)))) as pool:
        return {r for r, gone in zip(ranks, pool.map(down, ranks), strict=True) if gone}


# Errors of this process, not of the connection: out of descriptors, memory, buffers or local
# ports to connect from.
LOCAL_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS,
                          errno.EADDRNOTAVAIL, errno.EAGAIN})
LOCAL_ERROR_QUIET_S = 60.0
_local_error_logged = [-LOCAL_ERROR_QUIET_S]  # when the last such line was written


def _accepts(ip: str, port: int, timeout: float) -> bool | None:
    """True: it accepted; False: it refused, reset or was silent; None: this process could not
    try (LOCAL_ERRORS), so nothing is known."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError as err:
        if err.errno in LOCAL_ERRORS:
            if time.monotonic() - _local_error_logged[0] >= LOCAL_ERROR_QUIET_S:
                _local_error_logged[0] = time.monotonic()
                log.warning("cannot probe %s:%d from here: %s (not counted against the pod; "
                            "logged again after %g s at the earliest)", ip, port, err,
                            LOCAL_ERROR_QUIET_S)
            return None
        return False


# -- typed calls -------------------------------------------------------------------------------

def inventories(targets: Mapping[int, Target], token: Bearer,
                timeout: float = INVENTORY_TIMEOUT_SECONDS) -> dict[int, Inventory]:
    """Every sidecar's GET /inventory; SidecarError when any did not answer."""
    return every(targets, token, lambda _, c: c.inventory(), timeout)


def inventories_each(targets: Mapping[int, Target], token: Bearer,
                     timeout: float = INVENTORY_TIMEOUT_SECONDS,
                     relay_min: int = RELAY_MIN_RANKS, min_batch: int = MIN_BATCH,
                     ) -> tuple[dict[int, Inventory], list[str]]:
    """The inventories that came, and the silent sidecars in words (not an error: a plan
    goes on without a cut-off node's copies). From `relay_min` ranks on, one sidecar per
    batch relays for its batch; a batch whose relay fails is asked rank by rank."""
    if len(targets) < relay_min:
        return each(targets, token, lambda _, c: c.inventory(), timeout)
    batches = relay_batches(sorted(targets), min_batch)
    relayed, _ = each_by_rank({b[0]: targets[b[0]] for b in batches}, token,
                              _relay_ask(batches, targets, timeout), timeout)
    found: dict[int, Inventory] = {}
    silent: dict[int, str] = {}
    direct: dict[int, Target] = {}
    for batch in batches:
        answer = relayed.get(batch[0])
        if answer is None:  # the relay itself failed: ask its batch directly
            direct.update({r: targets[r] for r in batch})
            continue
        for rank in batch:
            if rank in answer.inventories:
                found[rank] = answer.inventories[rank]
            else:
                silent[rank] = f"rank {rank}: " + answer.failed.get(
                    rank, f"not in the answer of rank {batch[0]}'s relay")
    if direct:
        more, errors = each_by_rank(direct, token, lambda _, c: c.inventory(), timeout)
        found.update(more)
        silent.update(errors)
    return found, [silent[r] for r in sorted(silent)]


def relay_batches(ranks: Sequence[int], min_batch: int = MIN_BATCH) -> list[list[int]]:
    """`ranks` in consecutive batches of about sqrt(N) (at least `min_batch`, at most
    MAX_RELAYED + 1); the first of each relays for the rest."""
    size = min(MAX_RELAYED + 1, max(min_batch, math.ceil(math.sqrt(len(ranks)))))
    return [list(ranks[i:i + size]) for i in range(0, len(ranks), size)]


def _relay_ask(batches: Sequence[Sequence[int]], targets: Mapping[int, Target],
               timeout: float) -> Callable[[int, ControlClient], InventoriesAnswer]:
    by_relay = {b[0]: b for b in batches}

    def ask(rank: int, client: ControlClient) -> InventoriesAnswer:
        others = {r: f"{targets[r][0]}:{targets[r][1]}" for r in by_relay[rank][1:]}
        client.max_answer_bytes = relayed_answer_bytes(len(others))
        return client.inventories(InventoriesRequest(others, round(timeout * RELAY_SHARE, 3)))
    return ask


def launcher_statuses(targets: Mapping[int, Target], token: Bearer,
                      timeout: float = TIMEOUT_SECONDS) -> dict[int, LauncherStatus]:
    """Every launcher's GET /status (`targets`: launcher ports)."""
    return every(targets, token, lambda _, c: c.status(), timeout)


def restart(targets: Mapping[int, Target], token: Bearer,
            request: RestartRequest | Mapping[int, RestartRequest],
            timeout: float = RESTART_TIMEOUT_SECONDS) -> dict[int, RestartAnswer]:
    """POST /restart to every launcher (one request for all, or one per rank)."""
    body = _per_rank(request)
    return every(targets, token, lambda r, c: c.restart(body(r)), timeout)


def fetch(targets: Mapping[int, Target], token: Bearer, requests: Mapping[int, FetchRequest],
          timeout: float = TRANSFER_TIMEOUT_SECONDS,
          wait: float | None = TRANSFER_WAIT_SECONDS) -> dict[int, FetchAnswer]:
    """POST /fetch to each rank's sidecar with its own request. With `wait` (seconds), a
    transfer not done by then raises TransfersRunning with every rank's progress."""
    bodies = {r: replace(q, wait_seconds=wait) for r, q in requests.items()}
    return finished(every(targets, token, lambda r, c: c.fetch(bodies[r]),
                          _call_timeout(wait, timeout)))


def fetch_replicas(targets: Mapping[int, Target], token: Bearer,
                   request: FetchReplicasRequest | Mapping[int, FetchReplicasRequest],
                   timeout: float = TRANSFER_TIMEOUT_SECONDS,
                   wait: float | None = TRANSFER_WAIT_SECONDS) -> dict[int, FetchReplicasAnswer]:
    """POST /fetch-replicas; a sidecar that did not get every held rank is a failure.
    `wait` as for `fetch`."""
    body = _per_rank(request)
    return finished(every(targets, token,
                          lambda r, c: c.fetch_replicas(replace(body(r), wait_seconds=wait)),
                          _call_timeout(wait, timeout)))


def restore(targets: Mapping[int, Target], token: Bearer, request: RestoreRequest,
            timeout: float = TRANSFER_TIMEOUT_SECONDS,
            wait: float | None = TRANSFER_WAIT_SECONDS) -> dict[int, RestoreAnswer]:
    """POST /restore (from S3) to every sidecar; `wait` as for `fetch`."""
    body = replace(request, wait_seconds=wait)
    return finished(every(targets, token, lambda _, c: c.restore(body),
                          _call_timeout(wait, timeout)))


def committed_steps(targets: Sequence[Target], token: Bearer,
                    timeout: float = LISTING_TIMEOUT_SECONDS) -> tuple[int, ...]:
    """GET /committed-steps of the given sidecars of one job side by side: the first answer
    (one is enough, and a silent one must not hold up the rest). Raises ControlError: a
    refusal at once (S3 itself refused or is down: the others would say the same), else the
    last failure when none answered (`lists_no_steps` tells which)."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(targets)))
    try:
        asked = [pool.submit(_steps_of, target, token, timeout) for target in targets]
        last: ControlError | None = None
        for done in as_completed(asked):
            try:
                return done.result()
            except ControlError as err:
                if not lists_no_steps(err):
                    raise
                last = err
        raise last or ControlError("", COMMITTED_STEPS_PATH, "no sidecar to ask")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a silent one ends at its deadline


def lists_no_steps(err: ControlError) -> bool:
    """The sidecar did not answer, or is older than GET /committed-steps (404, during an
    upgrade): it says nothing about S3."""
    return err.status in (None, 404)


def _steps_of(target: Target, token: Bearer, timeout: float) -> tuple[int, ...]:
    ip, port = target
    return ControlClient(ip, port, token, timeout).committed_steps().steps


def persist(targets: Mapping[int, Target], token: Bearer, request: PersistRequest,
            timeout: float = TIMEOUT_SECONDS) -> dict[int, PersistAnswer]:
    """POST /persist (to S3) to every sidecar; with the request's wait_seconds, an upload
    not done by then raises TransfersRunning (asked again, the calls join the uploads)."""
    return finished(every(targets, token, lambda _, c: c.persist(request),
                          _call_timeout(request.wait_seconds, timeout)))


def commit(target: Target, token: Bearer, request: CommitRequest,
           timeout: float = TIMEOUT_SECONDS) -> CommitAnswer:
    """POST /commit to one sidecar (after every rank persisted the version)."""
    ip, port = target
    try:
        return ControlClient(ip, port, token, timeout).commit(request)
    except ControlError as err:
        raise SidecarError(str(err)) from err


def persist_and_commit(targets: Mapping[int, Target], token: Bearer, version: int,
                       timeout: float, wait: float | None = None) -> CommitAnswer:
    """Every rank's sidecar uploads `version` of its shard, then the lowest rank's commits
    it (the commit marker makes the step visible only once every shard is in S3). With
    `wait`, uploads not done by then raise TransfersRunning: call again to join them."""
    persist(targets, token, PersistRequest(version, wait), timeout)
    return commit(targets[min(targets)], token, CommitRequest(version), timeout)


# -- placement -------------------------------------------------------------------------------

def peers_bodies(placement: Placement, addresses: Mapping[int, SidecarAddress],
                 ) -> dict[int, Peers]:
    """Each rank's POST /peers body: whose shards it holds, whom it sends its own to, and
    where those peers listen."""
    bodies = {}
    for rank in placement.ranks:
        send_to, hold = placement.sends_to(rank), tuple(sorted(placement.receives_from(rank)))
        peers = {r: f"{addresses[r].ip}:{addresses[r].peer_port}"
                 for r in sorted(set(send_to) | set(hold))}
        bodies[rank] = Peers(peers, hold, send_to)
    return bodies


def deliver_peers(addresses: Mapping[int, SidecarAddress], bodies: Mapping[int, Peers],
                  token: Bearer, timeout: float = DELIVERY_TIMEOUT_SECONDS) -> list[str]:
    """POST each rank's placement to its sidecar, in parallel: the refusals in words
    ("rank 3: /peers unreachable (...)"), after trying every rank."""
    targets = {r: (addresses[r].ip, addresses[r].api_port) for r in bodies}
    _, errors = each(targets, token, lambda r, c: c.peers(bodies[r]), timeout,
                     lambda r, err: f"rank {r}: {err.path} {err.reason}")
    return errors


def deliver_placement(
    placement: Placement, addresses: Mapping[int, SidecarAddress], token: Bearer,
    timeout: float = TIMEOUT_SECONDS,
) -> None:
    """POST every rank's part of `placement` to its sidecar, in parallel; raise DeliveryError
    on any refusal (after trying every rank)."""
    bodies = peers_bodies(placement, addresses)
    errors = deliver_peers(addresses, bodies, token, timeout)
    if errors:
        raise DeliveryError(errors, len(bodies))
