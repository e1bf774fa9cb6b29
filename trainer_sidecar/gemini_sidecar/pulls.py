"""Shards pulled from their holders (POST /fetch, /fetch-replicas): the own rank into the slot
file, a held rank into the replica store; and whether what a finished pull brought is still
here (gemini_sidecar.transfers answers a repeated request from it only while it is)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gemini.control.transfers import ReplicaFetch
from gemini_sidecar.config import PeerAddress, Placement, SidecarConfig, parse_address
from gemini_sidecar.fetcher import Fetched, FetchRequest, fetch
from gemini_sidecar.local import LocalShard
from gemini_sidecar.metrics import SidecarMetrics
from gemini_sidecar.peer_client import FetchFailed
from gemini_sidecar.replicator import Replicator
from gemini_sidecar.store import ReplicaStore, StoreError
from gemini_sidecar.transfers import Progress


class Pulls:
    """One sidecar's pulls. ``placement``: the placement in force now; ``on_change``: the
    replica store changed (its gauges are refreshed)."""

    def __init__(self, cfg: SidecarConfig, local: LocalShard, store: ReplicaStore,
                 replicator: Replicator, metrics: SidecarMetrics,
                 placement: Callable[[], Placement], on_change: Callable[[], None]) -> None:
        self.cfg = cfg
        self._local, self._store, self._replicator = local, store, replicator
        self._metrics = metrics
        self._placement = placement
        self._on_change = on_change

    def holders_for(self, rank: int, given: Sequence[int | str] | None) -> list[PeerAddress]:
        """Holder addresses: given as ranks (looked up in the peer map) or host:port."""
        if not given:
            given = [rank] if rank != self.cfg.rank else []
        peers = self._placement().peers
        out = []
        for item in given:
            if isinstance(item, int):
                if item not in peers:
                    raise ValueError(f"no peer address for rank {item}; POST /peers first")
                out.append(peers[item])
            else:
                out.append(parse_address(item))
        if not out:
            raise ValueError(f"name the holders of rank {rank} to fetch it from")
        return out

    async def fetch(
        self, rank: int, version: int | None, holders: list[PeerAddress], into: str,
        progress: Progress | None = None,
    ) -> Fetched:
        """Pull (rank, version) from holders into local shm (own rank) or the replica store."""
        cfg = self.cfg
        req = FetchRequest(cfg.job, cfg.auth_token, cfg.max_frame_bytes, rank, version, holders,
                           cfg.chunk_bytes, encrypt=cfg.peer_encryption)
        progress = progress if progress is not None else Progress()
        started = time.perf_counter()
        if into == "shm":
            result = await self._fetch_into_shm(req, progress)
        else:
            result = await self._fetch_into_store(req, progress)
        self._metrics.fetch_seconds.observe(time.perf_counter() - started)
        return result

    async def _fetch_into_shm(self, req: FetchRequest, progress: Progress) -> Fetched:
        if req.rank != self.cfg.rank:
            raise ValueError(f"only this sidecar's own rank {self.cfg.rank} goes into shm")
        opened: list[Any] = []

        def allocate(version: int, length: int, crc: int) -> memoryview:
            slots, view = self._local.begin_write(version, length)
            opened.append(slots)
            return view

        try:
            result = await fetch(req, allocate, self._metrics, progress)
        except BaseException:
            for slots in opened[-1:]:
                slots.abort()
            raise
        info = opened[-1].commit(result.version, result.checksum)
        self._replicator.seen(info.seq)  # fetched from its holders: nothing to send
        self._metrics.latest_local_version.set(result.version)
        return result

    async def _fetch_into_store(self, req: FetchRequest, progress: Progress) -> Fetched:
        held = self._placement().hold_ranks
        if req.rank not in held:
            raise ValueError(f"rank {req.rank} is not among the ranks this sidecar holds "
                             f"{list(held)}; POST /peers first")

        def allocate(version: int, length: int, crc: int) -> memoryview:
            self._store.begin(req.rank, version, length, crc)
            return self._store.chunk_view(req.rank, version, 0, length)

        result = await fetch(req, allocate, self._metrics, progress)
        # fetch() checked the whole payload against its CRC-32: one piece with that CRC
        self._store.chunk_done(req.rank, result.version, 0, result.length, result.checksum)
        self._store.finish(req.rank, result.version, result.checksum)
        self._on_change()
        return result

    async def refill(self, holders: Mapping[int, Sequence[int | str]], version: int | None = None,
                     progress: Progress | None = None) -> tuple[ReplicaFetch, ...]:
        """Pull `version` (default: the newest complete) of every held rank (a replacement
        sidecar does this after its own shard; a recovery names the version it restores, which
        its owner may have newer ones of, and then every holder has it): from the holders given
        per rank, else from that rank's own sidecar. A rank whose `version` is already complete
        here is kept as it is. One failed rank does not stop the others; each gets its result
        or error."""
        results: list[ReplicaFetch] = []
        for rank in self._placement().hold_ranks:
            held = self._complete_replica(rank, version)
            if held is not None:  # already here: fetching again would overwrite this copy
                results.append(ReplicaFetch(rank, version, held, ()))
                continue
            try:
                got = await self.fetch(rank, version, self.holders_for(rank, holders.get(rank)),
                                       "store", progress)
            except (FetchFailed, ValueError, StoreError) as err:
                results.append(ReplicaFetch(rank, error=str(err)))
                continue
            results.append(ReplicaFetch(rank, got.version, got.length, got.holders_used))
        return tuple(results)

    # -- whether a finished pull still holds (gemini_sidecar.transfers) -------------------
    def has_local(self, version: int, checksum: int | None = None) -> bool:
        """Whether a slot holds `version` complete (with that CRC-32, when given)."""
        return any(i.version == version and i.complete and checksum in (None, i.checksum)
                   for i in self._local.slot_info())

    def has_replica(self, rank: int, version: int | None, checksum: int | None = None) -> bool:
        """Whether the store holds `version` of `rank` complete (with that CRC-32)."""
        return self._complete_replica(rank, version, checksum) is not None

    def still_fetched(self, into: str) -> Callable[[Fetched], bool]:
        if into == "shm":
            return lambda got: self.has_local(got.version, got.checksum)
        return lambda got: self.has_replica(got.rank, got.version, got.checksum)

    def still_refilled(self, results: Sequence[ReplicaFetch]) -> bool:
        return all(r.ok and self.has_replica(r.rank, r.version) for r in results)

    def _complete_replica(self, rank: int, version: int | None,
                          checksum: int | None = None) -> int | None:
        """The size of `version` of `rank` if the store holds it complete (with that CRC-32,
        when given), else None."""
        if version is None:
            return None
        return next((c.bytes for c in self._store.inventory()
                     if c.rank == rank and c.version == version and c.complete
                     and checksum in (None, c.checksum)), None)
