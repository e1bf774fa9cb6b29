"""Control and inventory HTTP API (aiohttp) of one sidecar: the server side of gemini.control.

GET /healthz and GET /metrics are open (probes and Prometheus); everything else must be signed,
as the operator or with the job token (gemini.control.verifier.admitted). Every body is read
with the contract's types (a bad one is answered 400 naming the field) and every answer written
with them; errors are ErrorAnswer, {"error": "<what to fix>"}, with a 4xx/5xx status. The order
callers must keep (placement before fetches, persist before commit, ...) is stated in
gemini.control. Bodies must arrive within the read timeout, be plain JSON with finite numbers
nested at most control.MAX_JSON_DEPTH deep, and name versions the slot files can hold (< 2^63):
anything else is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError

from gemini.control import auth, paths, strict, verifier
from gemini.control.files import parked_path, read_heartbeat, read_parked
from gemini.control.inventory import (
    InventoriesRequest,
    Inventory,
    LocalCopy,
    MemoryUse,
    PeerSending,
    ReplicaCopy,
    Sending,
)
from gemini.control.messages import (
    ErrorAnswer,
    Health,
    NotifyAnswer,
    NotifyRequest,
    Peers,
    ProfileAnswer,
    ProfileRequest,
)
from gemini.control.signing import Signed, audience_of
from gemini.control.transfers import (
    CommitRequest,
    FetchAnswer,
    FetchReplicasAnswer,
    FetchReplicasRequest,
    FetchRequest,
    PersistRequest,
    RestoreRequest,
    TransferRunning,
)
from gemini.control.verifier import RequestVerifier
from gemini.domain.traffic import IterationTimeline
from gemini.serving.gate import address_of, host_of
from gemini.slots.layout import SlotBusy
from gemini_sidecar.config import (
    ConfigError,
    Placement,
    SidecarConfig,
    make_placement,
    parse_address,
)
from gemini_sidecar.local import LocalShard, LocalShardError
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.pacing import Profile
from gemini_sidecar.peer_client import FetchFailed
from gemini_sidecar.peer_frames import PeerRefused
from gemini_sidecar.peer_server import ListenerHealth
from gemini_sidecar.pulls import Pulls
from gemini_sidecar.relay import relay_inventories
from gemini_sidecar.replicator import Replicator
from gemini_sidecar.s3 import S3Error
from gemini_sidecar.s3_checkpoints import S3Checkpoints
from gemini_sidecar.store import ReplicaStore, StoreError
from gemini_sidecar.transfers import Transfers, outcome

log = logging.getLogger(__name__)
OPEN_PATHS = paths.SIDECAR_OPEN_PATHS
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CLIENT_ERRORS = (ValueError, KeyError, TypeError, ConfigError, StoreError, LocalShardError)
MAX_VERSION = (1 << 63) - 1  # slot headers and peer frames hold a version in 63 bits


class SidecarParts(Protocol):
    """What the API drives and reports on: one sidecar's parts and the state the operator
    sets (gemini_sidecar.app.Sidecar)."""

    cfg: SidecarConfig
    metrics: SidecarMetrics
    local: LocalShard
    store: ReplicaStore
    replicator: Replicator
    transfers: Transfers
    pulls: Pulls
    checkpoints: S3Checkpoints
    placement: Placement
    pushed_profile: Profile | None

    def listener_health(self) -> dict[str, ListenerHealth]: ...

    def refuse_call(self, peer: str, reason: str) -> None: ...

    def notify(self, version: int, stall_seconds: float | None) -> None: ...

    def set_placement(self, placement: Placement) -> None: ...


SIDECAR_KEY: web.AppKey[SidecarParts] = web.AppKey("sidecar")
VERIFIER_KEY: web.AppKey[RequestVerifier] = web.AppKey("verifier")
# the request's checked signature (the body is checked by it)
SIGNED_KEY: web.RequestKey[Signed] = web.RequestKey("signed", Signed)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(ErrorAnswer(message).to_json(), status=status)


def _answer(answer: Any, status: int = 200) -> web.Response:
    """A contract answer (a dataclass with to_json) as its JSON."""
    return web.json_response(answer.to_json(), status=status)


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    if request.path not in OPEN_PATHS:
        signed = _admitted(request)
        if signed is None:
            sidecar.refuse_call(_peer_of(request), f"{request.method} {request.path[:100]} "
                                "without a signature that may make it")
            return _error(401, auth.CALL_REFUSED)
        request[SIGNED_KEY] = signed
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except json.JSONDecodeError as err:
        return _error(400, f"the body is not JSON: {err}")
    except _SlowBody:
        slow = _error(408, "the body did not arrive within the read timeout "
                      "(GEMINI_READ_TIMEOUT_S)")
        slow.force_close()  # the rest of the body may still come: not a next request
        return slow
    except _CLIENT_ERRORS as err:
        return _error(400, str(err))
    except (FetchFailed, PeerRefused) as err:
        return _error(502, str(err))
    except S3Error as err:
        return _error(502, f"S3: {err}")
    except (BotoCoreError, ClientError, Boto3Error) as err:  # S3 unreachable or refusing
        return _error(502, f"S3 request failed (training goes on; retry later): {err}")
    except SlotBusy as err:
        return _error(409, str(err))


def _peer_of(request: web.Request) -> str:
    transport = request.transport
    return address_of(transport.get_extra_info("peername") if transport else request.remote)


def _admitted(request: web.Request) -> Signed | None:
    # a header that is not UTF-8 reaches us with surrogate escapes: compare its raw bytes
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    job_token_allowed = request.method == "GET" or request.path in paths.SIDECAR_TRAINER_PATHS
    transport = request.transport
    arrived = audience_of(transport.get_extra_info("sockname")) if transport else ""
    return verifier.admitted(request.app[VERIFIER_KEY], given, request.method, request.raw_path,
                         arrived, host_of(_peer_of(request)), job_token_allowed)


class _SlowBody(Exception):
    """The request body did not arrive within the read timeout (408)."""


async def _body(request: web.Request) -> object:
    """The body's JSON (an empty body reads as {}); the contract's types check its shape."""
    limit = request.app[SIDECAR_KEY].cfg.limits.read_timeout_s
    try:
        raw = await asyncio.wait_for(request.read(), limit)
    except TimeoutError as err:
        raise _SlowBody from err
    signed = request.get(SIGNED_KEY)
    if signed is not None and not signed.body_matches(raw):
        raise ValueError("the body is not the one signed")
    return strict.parse_json(raw or b"{}")


def _check_version(value: int | None) -> None:
    """A version the slot files and peer frames can hold (ValueError: 400 otherwise)."""
    if value is not None and not 0 <= value <= MAX_VERSION:
        raise ValueError(f"'version' must be between 0 and 2^63-1, got {value}")


def health_of(sidecar: SidecarParts) -> tuple[bool, dict[str, Any]]:
    """Every listener's real state; unhealthy when one is dead (or cannot accept for long)."""
    listeners = sidecar.listener_health()
    healthy = all(h.healthy for h in listeners.values())
    doc = Health("ok" if healthy else "failing").to_json()
    doc["listeners"] = {name: h.to_json() for name, h in listeners.items()}
    return healthy, doc


async def healthz(request: web.Request) -> web.Response:
    """health_of, 503 when unhealthy (also served on the probe port: app.py)."""
    healthy, doc = health_of(request.app[SIDECAR_KEY])
    return web.json_response(doc, status=200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SIDECAR_KEY].metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


def inventory_of(sidecar: SidecarParts) -> Inventory:
    local = tuple(
        LocalCopy(sidecar.cfg.rank, info.version, info.complete, info.payload_len, info.checksum)
        for info in sidecar.local.slot_info()
        if info.version >= 0
    )
    beat = sidecar.cfg.heartbeat_file
    return Inventory(
        job=sidecar.cfg.job, rank=sidecar.cfg.rank, world_size=sidecar.cfg.world_size,
        local=local,
        replicas=tuple(ReplicaCopy(r.rank, r.version, r.complete, r.bytes, r.received_bytes,
                                   r.checksum) for r in sidecar.store.inventory()),
        sending=_sending(sidecar),
        memory=MemoryUse(sidecar.store.used_bytes, sidecar.cfg.memory_budget_bytes),
        placement=_peers_of(sidecar.placement),
        heartbeat=beat is not None,
        progress=None if beat is None else read_heartbeat(beat),
        parked=None if beat is None else read_parked(parked_path(beat)),
    )


def _sending(sidecar: SidecarParts) -> Sending:
    status = sidecar.replicator.status
    return Sending(
        mode=sidecar.cfg.traffic_mode, notified_version=status.notified_version,
        skipped_versions=status.skipped_versions, fits_idle_spans=status.fits_idle_spans,
        interval_iterations=status.interval_iterations, plan=status.plan_reason,
        peers={r: PeerSending(p.acked_version, p.sending_version, p.last_error, p.last_seconds)
               for r, p in status.peers.items()},
        acknowledged_version=status.acknowledged_version,
        effective_interval=status.effective_interval,
    )


def _peers_of(placement: Placement) -> Peers:
    return Peers({r: str(a) for r, a in placement.peers.items()}, tuple(placement.hold_ranks),
                 tuple(placement.send_to))


async def inventory(request: web.Request) -> web.Response:
    return _answer(inventory_of(request.app[SIDECAR_KEY]))


async def inventories(request: web.Request) -> web.Response:
    """Other sidecars' inventories with this one's (the operator's batched poll)."""
    sidecar = request.app[SIDECAR_KEY]
    req = InventoriesRequest.from_json(await _body(request))
    token = sidecar.cfg.auth_token.decode(errors="replace")
    return _answer(await relay_inventories(inventory_of(sidecar), req, token))


async def notify(request: web.Request) -> web.Response:
    """The trainer says: version `version` is complete in shm (`stall_seconds`: its stall)."""
    req = NotifyRequest.from_json(await _body(request))
    _check_version(req.version)
    if req.stall_seconds is not None and req.stall_seconds < 0:
        raise ValueError(f"'stall_seconds' must be >= 0, got {req.stall_seconds}")
    request.app[SIDECAR_KEY].notify(req.version, req.stall_seconds)
    return _answer(NotifyAnswer(req.version), status=202)


async def peers(request: web.Request) -> web.Response:
    """A new placement, replacing the current one as a whole."""
    sidecar = request.app[SIDECAR_KEY]
    req = Peers.from_json(await _body(request))
    placement = make_placement(
        {r: parse_address(a) for r, a in req.peers.items()},
        tuple(sorted(set(req.hold_ranks))), tuple(sorted(set(req.send_to))),
        sidecar.cfg.rank, sidecar.cfg.world_size,
    )
    sidecar.set_placement(placement)
    return _answer(_peers_of(sidecar.placement))


async def profile(request: web.Request) -> web.Response:
    """A traffic profile: when the training's own traffic runs in each iteration."""
    sidecar = request.app[SIDECAR_KEY]
    req = ProfileRequest.from_json(await _body(request))
    sidecar.pushed_profile = Profile(tuple(IterationTimeline(it.length, it.ops)
                                           for it in req.iterations))
    return _answer(ProfileAnswer(len(sidecar.pushed_profile.iterations)))


def _transfer_answer(answer: Any) -> web.Response:
    """A transfer's answer, or 202 with its progress while it runs (gemini.control, rule 7)."""
    return _answer(answer, status=202 if isinstance(answer, TransferRunning) else 200)


async def fetch(request: web.Request) -> web.Response:
    """Pull a rank's shard from holders: the own rank into shm, a held rank into the store."""
    sidecar = request.app[SIDECAR_KEY]
    req = FetchRequest.from_json(await _body(request))
    _check_version(req.version)
    into = req.into or ("shm" if req.rank == sidecar.cfg.rank else "store")
    pulls = sidecar.pulls
    holders = pulls.holders_for(req.rank, list(req.holders))
    transfer = sidecar.transfers.start_or_join(
        ("fetch", req.rank, req.version, into), "fetch", req.rank, req.version,
        lambda progress: pulls.fetch(req.rank, req.version, holders, into, progress),
        pulls.still_fetched(into))
    got = await outcome(transfer, req.wait_seconds)
    if isinstance(got, TransferRunning):
        return _answer(got, status=202)
    return _answer(FetchAnswer(got.rank, got.version, got.length, got.checksum,
                               tuple(got.holders_used)))


async def fetch_replicas(request: web.Request) -> web.Response:
    """Re-pull every held rank at a version (default: the newest complete); 502 when some
    rank did not come (the body says which)."""
    sidecar = request.app[SIDECAR_KEY]
    req = FetchReplicasRequest.from_json(await _body(request))
    _check_version(req.version)
    given = {r: list(hs) for r, hs in req.holders.items()}
    transfer = sidecar.transfers.start_or_join(
        ("fetch-replicas", req.version), "fetch-replicas", None, req.version,
        lambda progress: sidecar.pulls.refill(given, req.version, progress),
        sidecar.pulls.still_refilled)
    got = await outcome(transfer, req.wait_seconds)
    if isinstance(got, TransferRunning):
        return _answer(got, status=202)
    answer = FetchReplicasAnswer(got)
    return _answer(answer, status=200 if answer.ok else 502)


async def persist(request: web.Request) -> web.Response:
    """Upload a version of the own shard (default: the newest) to S3."""
    sidecar = request.app[SIDECAR_KEY]
    req = PersistRequest.from_json(await _body(request))
    _check_version(req.version)
    transfer = sidecar.transfers.start_or_join(
        ("persist", req.version), "persist", sidecar.cfg.rank, req.version,
        lambda progress: sidecar.checkpoints.persist(req.version, progress))
    return _transfer_answer(await outcome(transfer, req.wait_seconds))


async def commit(request: web.Request) -> web.Response:
    """Verify every rank's object, write the commit marker, apply retention."""
    req = CommitRequest.from_json(await _body(request))
    _check_version(req.version)
    return _answer(await request.app[SIDECAR_KEY].checkpoints.commit(req.version))


async def restore(request: web.Request) -> web.Response:
    """Download the own rank of a committed step (default: the newest) into shm."""
    sidecar = request.app[SIDECAR_KEY]
    req = RestoreRequest.from_json(await _body(request))
    _check_version(req.version)
    transfer = sidecar.transfers.start_or_join(
        ("restore", req.version), "restore", sidecar.cfg.rank, req.version,
        lambda progress: sidecar.checkpoints.restore(req.version, progress),
        lambda got: sidecar.pulls.has_local(got.version))
    return _transfer_answer(await outcome(transfer, req.wait_seconds))


async def committed_steps(request: web.Request) -> web.Response:
    """The steps this job committed to S3 (the operator plans recoveries with them)."""
    return _answer(await request.app[SIDECAR_KEY].checkpoints.committed_steps())


def make_app(sidecar: SidecarParts) -> web.Application:
    app = web.Application(middlewares=[_auth_and_errors], client_max_size=1 << 20)
    app[SIDECAR_KEY] = sidecar
    app[VERIFIER_KEY] = RequestVerifier(sidecar.cfg.auth_token, sidecar.cfg.control_public_key)
    app.add_routes([
        web.get(paths.HEALTHZ_PATH, healthz),
        web.get(paths.METRICS_PATH, metrics),
        web.get(paths.INVENTORY_PATH, inventory),
        web.post(paths.INVENTORIES_PATH, inventories),
        web.post(paths.NOTIFY_PATH, notify),
        web.post(paths.COMMITTED_PATH, notify),  # the path gemini_trainer's Checkpointer uses
        web.post(paths.PEERS_PATH, peers),
        web.post(paths.PROFILE_PATH, profile),
        web.post(paths.FETCH_PATH, fetch),
        web.post(paths.FETCH_REPLICAS_PATH, fetch_replicas),
        web.post(paths.PERSIST_PATH, persist),
        web.post(paths.COMMIT_PATH, commit),
        web.post(paths.RESTORE_PATH, restore),
        web.get(paths.COMMITTED_STEPS_PATH, committed_steps),
    ])
    return app
