"""The operator's cost of one inventory poll of a large job: every sidecar asked by the
operator (the baseline) against one relay per batch of about sqrt(N) ranks (POST
/inventories), in the same run.

The sidecars are stand-ins that serve what a real sidecar of an N-rank job with m = 2 answers
(`GET /inventory`: two local slots, one replica, its peer's sending state, placement and a
heartbeat) and relay with the sidecar's own code (gemini_sidecar.relay), one address each on
loopback (127.1.x.y, as pod IPs), all in one server process. The poll is the operator's own
`gemini_operator.calls.sidecars.inventories_each` in this process: what is measured is this
process's CPU time (every thread) and wall time per poll, and the calls it makes. The server
shares the two cores, so wall times say more about it than about the operator; CPU seconds
are the operator's alone.

Per size (--sizes, default 1024 and 8192 ranks) and mode, --runs polls (default 5), median.
A poll in which any rank stayed silent is an error (no figure is made of partial answers).
Last line: the CPU of a batched poll at the largest size as a fraction of the rank-by-rank
poll's (target <= 0.25).
Ctrl-C or SIGTERM (a timeout) stops it cleanly: the server process is stopped (exit 130/143).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.cleanup import cleaning_up

from gemini.control.inventory import (
    InventoriesRequest,
    Inventory,
    LocalCopy,
    MemoryUse,
    PeerSending,
    ReplicaCopy,
    Sending,
)
from gemini.control.launcher import Progress
from gemini.control.messages import Peers

TOKEN = "poll-cost-bench-token-0123456789"
PORT = 17080
TIMEOUT_S = 10.0  # generous: the figure is the cost of whole answers, not of timeouts
TARGET = 0.25
SHARD = 271 * 1024 * 1024


def address(rank: int) -> str:
    return f"127.1.{rank // 250}.{rank % 250 + 1}"


def inventory(rank: int, world: int) -> Inventory:
    """What a sidecar of rank `rank` answers in steady state (m = 2, pairs of ranks)."""
    partner = rank ^ 1 if rank ^ 1 < world else rank
    peer = f"{address(partner)}:7070"
    return Inventory(
        job="scale", rank=rank, world_size=world,
        local=(LocalCopy(rank, 100, True, SHARD, 3735928559),
               LocalCopy(rank, 101, False, SHARD, 0)),
        replicas=(ReplicaCopy(partner, 100, True, SHARD, SHARD, 12345),),
        sending=Sending("interleaved", 101, 0, True, None, "fits the idle spans",
                        {partner: PeerSending(100, 101, "", 0.25)}, 100, 1),
        memory=MemoryUse(2 * SHARD, 8 * SHARD),
        placement=Peers({partner: peer}, (partner,), (partner,)),
        heartbeat=True, progress=Progress(101, time.time(), 0.3))


# -- the stand-in sidecars (a child process) ----------------------------------------------------

def serve(world: int) -> None:
    from aiohttp import web

    from gemini.control.signing import audience_of
    from gemini.control.verifier import RequestVerifier
    from gemini_sidecar.relay import relay_inventories

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ranks = {address(r): r for r in range(world)}
    answers = {r: inventory(r, world) for r in range(world)}
    bodies = {r: json.dumps(i.to_json()).encode() for r, i in answers.items()}

    def rank_of(request: web.Request) -> int:
        return ranks[request.transport.get_extra_info("sockname")[0]]

    verifier = RequestVerifier(TOKEN.encode(), None)  # signed as a sidecar checks it

    def allowed(request: web.Request) -> bool:
        header = request.headers.get("Authorization", "").encode()
        here = audience_of(request.transport.get_extra_info("sockname"))
        return verifier.check(header, request.method, request.raw_path, here) is not None

    async def get_inventory(request: web.Request) -> web.Response:
        if not allowed(request):
            return web.json_response({"error": "token"}, status=401)
        return web.Response(body=bodies[rank_of(request)], content_type="application/json")

    async def post_inventories(request: web.Request) -> web.Response:
        if not allowed(request):
            return web.json_response({"error": "token"}, status=401)
        req = InventoriesRequest.from_json(await request.json())
        answer = await relay_inventories(answers[rank_of(request)], req, TOKEN)
        return web.json_response(answer.to_json())

    async def main() -> None:
        app = web.Application()
        app.add_routes([web.get("/inventory", get_inventory),
                        web.post("/inventories", post_inventories)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for host in ranks:
            await web.TCPSite(runner, host, PORT, backlog=4096).start()
        print("serving", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# -- the operator's side ---------------------------------------------------------------------------

def poll(world: int, batched: bool) -> tuple[float, float, int]:
    """One poll: (CPU seconds, wall seconds, calls made)."""
    from gemini_operator.calls import sidecars

    targets = {r: (address(r), PORT) for r in range(world)}
    relay_min = sidecars.RELAY_MIN_RANKS if batched else world + 1
    cpu, wall = time.process_time(), time.perf_counter()
    found, silent = sidecars.inventories_each(targets, TOKEN, TIMEOUT_S, relay_min)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if silent or len(found) != world:
        raise SystemExit(f"{len(silent)} of {world} ranks did not answer "
                         f"({'batched' if batched else 'rank by rank'}): {silent[:2]}")
    calls = len(sidecars.relay_batches(sorted(targets))) if batched else world
    return cpu, wall, calls


def measure(world: int, runs: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for batched in (False, True):
        poll(world, batched)  # warm-up: connections, imports, caches
        samples = [poll(world, batched) for _ in range(runs)]
        mode = "batched" if batched else "rank_by_rank"
        out[mode] = {"cpu_s": round(statistics.median(s[0] for s in samples), 4),
                     "wall_s": round(statistics.median(s[1] for s in samples), 3),
                     "calls": samples[0][2]}
        print(f"{world} ranks, {mode}: {out[mode]['calls']} calls, operator CPU "
              f"{out[mode]['cpu_s']:.3f} s, wall {out[mode]['wall_s']:.2f} s "
              f"(median of {runs})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,8192")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    with cleaning_up() as cleanup:
        for world in sizes:
            server = cleanup.spawn([sys.executable, __file__, "--serve", str(world)],
                                   stdout=subprocess.PIPE, text=True)
            assert server.stdout is not None
            if server.stdout.readline().strip() != "serving":
                raise SystemExit(f"the stand-in sidecars for {world} ranks did not start")
            try:
                results[world] = measure(world, args.runs)
            finally:
                cleanup.stop_child(server, grace=5)
    largest = results[max(sizes)]
    ratio = largest["batched"]["cpu_s"] / max(largest["rank_by_rank"]["cpu_s"], 1e-9)
    print(json.dumps({"metric": f"operator_cpu_per_poll_batched_vs_rank_by_rank_{max(sizes)}",
                      "value": round(ratio, 3), "target": TARGET, "better": "lower",
                      "unit": "ratio", "sizes": {str(k): v for k, v in results.items()}}))


if __name__ == "__main__":
    main()
