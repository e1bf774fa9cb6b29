"""Control and inventory HTTP API (aiohttp) of one sidecar.

GET /healthz and GET /metrics are open (probes and Prometheus); everything else needs the
job token as `Authorization: Bearer <token>`. Bodies are JSON; errors are
{"error": "<what to fix>"} with a 4xx/5xx status.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web
from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError

from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import ConfigError, make_placement, parse_peers
from gemini_sidecar.local import LocalShardError
from gemini_sidecar.pacing import profile_from_json
from gemini_sidecar.peer_client import FetchFailed
from gemini_sidecar.protocol import PeerRefused
from gemini_sidecar.s3 import S3Error
from gemini_sidecar.store import StoreError
from gemini_trainer.shm import SlotBusy

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/healthz", "/metrics"})
SIDECAR_KEY = web.AppKey("sidecar", Sidecar)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CLIENT_ERRORS = (ValueError, KeyError, TypeError, ConfigError, StoreError, LocalShardError)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    sidecar = request.app[SIDECAR_KEY]
    if request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        expected = b"Bearer " + sidecar.cfg.auth_token
        if not hmac.compare_digest(given.encode(), expected):
            log.warning("refused API call %s %s without the job token", request.method,
                        request.path)
            return _error(401, "send the job token as 'Authorization: Bearer <token>'")
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except json.JSONDecodeError as err:
        return _error(400, f"the body is not JSON: {err}")
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


async def _body(request: web.Request) -> dict[str, Any]:
    doc = json.loads(await request.text() or "{}")
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object")
    return doc


def _opt_int(doc: dict[str, Any], key: str) -> int | None:
    value = doc.get(key)
    return None if value is None else int(value)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SIDECAR_KEY].metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


def inventory_doc(sidecar: Sidecar) -> dict[str, Any]:
    local = [
        {"rank": sidecar.cfg.rank, "version": info.version, "complete": info.complete,
         "bytes": info.payload_len, "checksum": info.checksum}
        for info in sidecar.local.slot_info()
        if info.version >= 0
    ]
    status = sidecar.replicator.status
    return {
        "job": sidecar.cfg.job,
        "rank": sidecar.cfg.rank,
        "world_size": sidecar.cfg.world_size,
        "local": local,
        "replicas": [asdict(r) for r in sidecar.store.inventory()],
        "sending": {
            "mode": sidecar.cfg.traffic_mode,
            "notified_version": status.notified_version,
            "skipped_versions": status.skipped_versions,
            "fits_idle_spans": status.fits_idle_spans,
            "interval_iterations": status.interval_iterations,
            "plan": status.plan_reason,
            "peers": {str(r): asdict(p) for r, p in status.peers.items()},
        },
        "memory": {"used_bytes": sidecar.store.used_bytes,
                   "budget_bytes": sidecar.cfg.memory_budget_bytes},
        "placement": {
            "peers": {str(r): str(a) for r, a in sidecar.placement.peers.items()},
            "hold_ranks": list(sidecar.placement.hold_ranks),
            "send_to": list(sidecar.placement.send_to),
        },
    }


async def inventory(request: web.Request) -> web.Response:
    return web.json_response(inventory_doc(request.app[SIDECAR_KEY]))


async def notify(request: web.Request) -> web.Response:
    """The trainer says: version `version` is complete in shm (`stall_seconds`: its stall)."""
    doc = await _body(request)
    stall = doc.get("stall_seconds")
    request.app[SIDECAR_KEY].notify(int(doc["version"]), None if stall is None else float(stall))
    return web.json_response({"accepted": int(doc["version"])}, status=202)


async def peers(request: web.Request) -> web.Response:
    """New placement: {"peers": {rank: "host:port"} | "0=h:p,...", "hold_ranks", "send_to"}."""
    sidecar = request.app[SIDECAR_KEY]
    doc = await _body(request)
    raw = doc.get("peers", {})
    peer_map = parse_peers(raw if isinstance(raw, str) else json.dumps(raw))
    placement = make_placement(
        peer_map,
        tuple(sorted({int(r) for r in doc.get("hold_ranks", [])})),
        tuple(sorted({int(r) for r in doc.get("send_to", [])})),
        sidecar.cfg.rank, sidecar.cfg.world_size,
    )
    sidecar.set_placement(placement)
    return web.json_response(inventory_doc(sidecar)["placement"])


async def profile(request: web.Request) -> web.Response:
    """A traffic profile: {"iterations": [{"length": s, "ops": [[start, end], ...]}, ...]}."""
    sidecar = request.app[SIDECAR_KEY]
    sidecar.pushed_profile = profile_from_json(await _body(request))
    return web.json_response({"iterations": len(sidecar.pushed_profile.iterations)})


async def fetch(request: web.Request) -> web.Response:
    """{"rank": r, "version": v|null, "holders": [rank | "host:port", ...], "into": "shm"|
    "store"}: pull from holders (the own rank into shm, a held rank into the replica store)."""
    sidecar = request.app[SIDECAR_KEY]
    doc = await _body(request)
    rank = int(doc["rank"])
    into = doc.get("into") or ("shm" if rank == sidecar.cfg.rank else "store")
    if into not in ("shm", "store"):
        raise ValueError('"into" must be "shm" or "store"')
    given = [h if isinstance(h, str) else int(h) for h in doc.get("holders", [])]
    result = await sidecar.fetch(rank, _opt_int(doc, "version"), sidecar.holders_for(rank, given),
                                 into)
    return web.json_response(asdict(result))


async def fetch_replicas(request: web.Request) -> web.Response:
    """{"holders": {"<rank>": [rank | "host:port", ...]}, "version": v|null} (both optional):
    re-pull every held rank, at that version (default: the newest complete)."""
    doc = await _body(request)
    given = {int(r): [h if isinstance(h, str) else int(h) for h in hs]
             for r, hs in dict(doc.get("holders") or {}).items()}
    results = await request.app[SIDECAR_KEY].refill(given, _opt_int(doc, "version"))
    status = 200 if all("error" not in r for r in results) else 502
    return web.json_response({"replicas": results}, status=status)


async def persist(request: web.Request) -> web.Response:
    """{"version": v|null}: upload that version of the own shard (default: newest) to S3."""
    doc = await _body(request)
    return web.json_response(await request.app[SIDECAR_KEY].persist(_opt_int(doc, "version")))


async def commit(request: web.Request) -> web.Response:
    """{"version": v}: verify every rank's object, write the commit marker, apply retention."""
    doc = await _body(request)
    return web.json_response(await request.app[SIDECAR_KEY].commit(int(doc["version"])))


async def restore(request: web.Request) -> web.Response:
    """{"version": v|null}: download the own rank of a committed step into shm."""
    doc = await _body(request)
    result = await request.app[SIDECAR_KEY].restore_from_s3(_opt_int(doc, "version"))
    return web.json_response(result)


def make_app(sidecar: Sidecar) -> web.Application:
    app = web.Application(middlewares=[_auth_and_errors], client_max_size=1 << 20)
    app[SIDECAR_KEY] = sidecar
    app.add_routes([
        web.get("/healthz", healthz),
        web.get("/metrics", metrics),
        web.get("/inventory", inventory),
        web.post("/notify", notify),
        web.post("/v1/local/committed", notify),  # the path gemini_trainer's Checkpointer uses
        web.post("/peers", peers),
        web.post("/profile", profile),
        web.post("/fetch", fetch),
        web.post("/fetch-replicas", fetch_replicas),
        web.post("/persist", persist),
        web.post("/commit", commit),
        web.post("/restore", restore),
    ])
    return app
