"""POST /inventories: a sidecar asks other sidecars of its job for their inventories on the
operator's behalf, so the operator of a large job makes one call per batch of ranks instead
of one per rank (gemini_operator.calls.sidecars.inventories_each).

Every relayed GET goes out at once (asyncio, no thread per call), each under the request's
deadline and size cap, signed with this sidecar's job token (GET /inventory takes it; the
token itself never crosses the network). Whatever did
not answer in time, or answered something that is not an inventory of the rank asked, is
filed under `failed` with the reason: the operator tells silence from answers per rank, as
when it asks each sidecar itself.
"""

from __future__ import annotations

import asyncio

import aiohttp

from gemini.control import inventory as control_inventory
from gemini.control import paths
from gemini.control import strict as control_strict
from gemini.control.client import signed_header
from gemini.control.inventory import InventoriesAnswer, InventoriesRequest, Inventory
from gemini.control.signing import Signer, audience

# Sockets one relay call opens at once: a batch is a few dozen ranks.
MAX_CONNECTIONS = 128


async def relay_inventories(own: Inventory, request: InventoriesRequest, token: str
                            ) -> InventoriesAnswer:
    """The inventories of `request.sidecars` (this sidecar's own included as `own`)."""
    others = {r: a for r, a in request.sidecars.items() if r != own.rank}
    timeout = aiohttp.ClientTimeout(total=request.timeout_seconds)
    connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, force_close=True)
    signer = Signer.job(token) if token else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        ranks = sorted(others)
        answers = await asyncio.gather(*(_ask(session, others[r], signer) for r in ranks))
    inventories: dict[int, Inventory] = {own.rank: own}
    failed: dict[int, str] = {}
    for rank, (inventory, why) in zip(ranks, answers, strict=True):
        if inventory is None:
            failed[rank] = f"{others[rank]}{paths.INVENTORY_PATH}: {why}"
        elif inventory.rank != rank:
            failed[rank] = f"{others[rank]} answered with the inventory of rank {inventory.rank}"
        else:
            inventories[rank] = inventory
    return InventoriesAnswer(inventories, failed)


async def _ask(session: aiohttp.ClientSession, address: str, signer: Signer | None
               ) -> tuple[Inventory | None, str]:
    """(the inventory, "") or (None, why not)."""
    url = f"http://{address}{paths.INVENTORY_PATH}"
    limit = control_inventory.MAX_RELAYED_INVENTORY_BYTES
    headers = {}
    if signer is not None:  # for the address asked: the answerer checks it is its own
        host, _, port = address.rpartition(":")
        headers["Authorization"] = signed_header(signer, "GET", paths.INVENTORY_PATH,
                                                 audience(host, int(port)))
    try:
        async with session.get(url, allow_redirects=False, headers=headers) as answer:
            if answer.status != 200:
                return None, f"answered {answer.status}"
            body = await _read_up_to(answer.content, limit + 1)
    except TimeoutError:
        return None, "no answer within the deadline"
    except (aiohttp.ClientError, OSError) as err:
        return None, f"unreachable ({type(err).__name__}: {err})"[:300]
    if len(body) > limit:
        return None, f"an inventory over {limit} bytes"
    try:
        return Inventory.from_json(control_strict.parse_json(body)), ""
    except ValueError as err:
        return None, f"not an inventory ({err})"[:300]


async def _read_up_to(stream: aiohttp.StreamReader, most: int) -> bytes:
    """The whole body, or its first `most` bytes: an answer comes in as many packets as
    the network splits it into (one read returns only what has arrived)."""
    body = bytearray()
    while len(body) < most:
        chunk = await stream.read(most - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)
